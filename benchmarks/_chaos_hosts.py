"""benchmarks/chaos.py's job on three network-namespace hosts (root), as on three machines
(tests/multihost/netns.py): the ps and the two workers each on a host of its own; with
`ps_replicas=2`, two ps tasks mirrored on each other on two hosts with a worker beside the second, or four, two
on each of those hosts (each part mirrored on the other host: the ring takes the hosts in turn); a launcher
per task. A host can be killed (every process on it, then started again, or lost for good) or cut off
for a while (its cable unplugged).

With `store="etcd"` every host also runs a member of a 3-member etcd cluster (tests/cluster/_etcd.py,
data on tmpfs, as a machine's disk) that holds the rendezvous (`--store etcd://...`); a lost host
loses its member too, and both come back when the host does."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional

_TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(_TESTS / "multihost"), str(_TESTS / "cluster")]
from _etcd import member_argv  # noqa: E402
from netns import Hosts  # noqa: E402

from chaos import Output, kill_pid  # noqa: E402

# the tasks each host runs, by the number of ps tasks, one launcher each: 1 ps + 2 workers, or 2 ps whose parts are
# mirrored on each other (on different hosts, so that a host's loss leaves every part a copy) + 2 workers, or 4 ps,
# two on each of two hosts (0 and 1 on the first: their mirrors are on 2 and 3, and theirs on 1 and 0) + 2 workers
_PLACES = {1: ((("ps", 0),), (("worker", 0),), (("worker", 1),)),
           2: ((("ps", 0),), (("ps", 1), ("worker", 0)), (("worker", 1),)),
           4: ((("ps", 0), ("ps", 1)), (("ps", 2), ("ps", 3), ("worker", 0)), (("worker", 1),))}


class NamespaceHosts:
    """The cluster across three namespace hosts; a task or a whole host can be killed, a host started again."""

    def __init__(self, work: Path, job_argv: List[str], env: Dict[str, str], store: Optional[str] = None,
                 ps_replicas: int = 1, ps: int = 1):
        self.hosts = Hosts(3, work)
        self.output = Output()
        self.work = work
        self.job_argv = job_argv
        self.places = _PLACES[ps]
        self.env = {"TOWERFLOW_CLUSTER_TOKEN": "chaos-" + os.urandom(4).hex(), "PYTHONPATH": env["PYTHONPATH"]}
        self.flags = ["--max-restarts", "1000", "--logdir", str(work / "logdir"), "--ps-replicas", str(ps_replicas)]
        self.etcd: List = []
        self.lost: List[int] = []  # hosts lost for good: their launchers' exits do not count
        self._timers: List[threading.Timer] = []
        self._etcd_data: Optional[Path] = None
        try:
            if store == "etcd":
                self._start_etcd()
            cluster: Dict[str, list] = {}
            for i, tasks in enumerate(self.places):
                for job, index in tasks:
                    cluster.setdefault(job, []).append((index, f"{self.hosts[i].name}:{7100 + len(cluster[job]) * 10 + i}"))
            self.cluster_file = work / "cluster.json"
            self.cluster_file.write_text(json.dumps({job: [a for _, a in sorted(e)] for job, e in cluster.items()}))
            self.procs = [[self._start(i, job, index) for job, index in tasks] for i, tasks in enumerate(self.places)]
        except BaseException:
            self.close()
            raise

    def _start_etcd(self) -> None:
        self._etcd_data = Path(tempfile.mkdtemp(prefix="towerflow-chaos-etcd-",
                                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self._peers = ",".join(f"m{i}=http://{h.address}:2380" for i, h in enumerate(self.hosts.hosts))
        self.etcd = [self._start_member(i) for i in range(3)]
        members = [(h.address, 2379) for h in self.hosts.hosts]
        # asked from a host: this machine's own network does not reach the hosts' bridge (and must not try)
        ready = ("import sys; sys.path.insert(0, sys.argv[1]); from _etcd import wait_ready; "
                 "wait_ready([(a, 2379) for a in sys.argv[2:]], timeout=60)")
        argv = [sys.executable, "-c", ready, str(_TESTS / "cluster"), *(h.address for h in self.hosts.hosts)]
        done = subprocess.run(self.hosts[0].command(argv), env={**os.environ, **self.env}, capture_output=True,
                              text=True, timeout=90)
        if done.returncode:
            raise RuntimeError(f"etcd on the hosts did not come up: {done.stderr[-2000:]}")
        self.flags += ["--store", "etcd://" + ",".join(f"{a}:{p}" for a, p in members) + f"/chaos-{self.hosts.tag}"]

    def _start_member(self, i: int):
        host = self.hosts[i]
        argv = member_argv(f"m{i}", host.address, 2379, 2380, self._peers, self._etcd_data / f"m{i}", self.hosts.tag)
        return self.hosts.start(host, argv, f"etcd-m{i}-{len(self.hosts.procs)}")

    def _start(self, i: int, job: str, index: int):
        proc = self.hosts.launch(self.hosts[i], self.cluster_file, job, index, self.job_argv, env=self.env,
                                 launch_flags=self.flags)
        self.output.follow(proc.log)
        return proc

    def running(self) -> bool:
        return any(p.popen.poll() is None for i, procs in enumerate(self.procs) if i not in self.lost for p in procs)

    def targets(self) -> List[str]:
        return [f"/job:{job}/task:{index}" for tasks in self.places for job, index in tasks]

    def ps_only_targets(self) -> List[str]:
        """The tasks of hosts that hold ps tasks alone: the hosts a replicated job can lose for good."""
        return [f"/job:{job}/task:{index}" for tasks in self.places if all(j == "ps" for j, _ in tasks)
                for job, index in tasks]

    def kill_task(self, task: str) -> bool:
        pid = self.output.pids().get(task)
        return pid is not None and kill_pid(pid)

    def _host_of(self, task: str) -> int:
        return next(i for i, tasks in enumerate(self.places) if any(f"/job:{j}/task:{k}" == task for j, k in tasks))

    def cut_host(self, task: str, seconds: float) -> bool:
        """The task's host loses its network cable for `seconds`: every process on it lives on, cut off from the
        others (and its etcd member from the other two); then the cable is plugged back."""
        host = self.hosts[self._host_of(task)]
        host.link(False)
        timer = threading.Timer(seconds, host.link, args=(True,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        return True

    def kill_host(self, task: str, again: bool = True) -> bool:
        """Every process of the task's host dies (its launchers too); then its launchers start again, or, not
        `again`, the host is lost for good (its etcd member too)."""
        i = self._host_of(task)
        if i in self.lost or all(p.popen.poll() is not None for p in self.procs[i]):
            return False
        for p in self.procs[i]:
            p.kill()
        if not again:
            if self.etcd:
                self.etcd[i].kill()
            self.lost.append(i)
            return True
        if self.etcd:
            self.etcd[i].kill()
            self.etcd[i] = self._start_member(i)  # the machine's disk kept its data
        self.procs[i] = [self._start(i, job, index) for job, index in self.places[i]]
        return True

    def exit_code(self, timeout: float) -> int:
        codes = [p.popen.wait(timeout) for i, procs in enumerate(self.procs) if i not in self.lost for p in procs]
        return next((c for c in codes if c), 0)

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self.hosts.close()
        if self._etcd_data is not None:
            shutil.rmtree(self._etcd_data, ignore_errors=True)
