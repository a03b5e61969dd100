"""benchmarks/chaos.py's job on three network-namespace hosts (root): the ps and the two workers each on
a host of its own under a launcher of its own, as on three machines (tests/multihost/netns.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "multihost"))
from netns import Hosts  # noqa: E402

from chaos import Output  # noqa: E402

_PLACES = (("ps", 0), ("worker", 0), ("worker", 1))  # host i runs _PLACES[i]


class NamespaceHosts:
    """The cluster across three namespace hosts; a task or a whole host can be killed, a host started again."""

    def __init__(self, work: Path, job_argv: List[str], env: Dict[str, str]):
        self.hosts = Hosts(3, work)
        self.output = Output()
        self.work = work
        self.job_argv = job_argv
        self.env = {"TOWERFLOW_CLUSTER_TOKEN": "chaos-" + os.urandom(4).hex(), "PYTHONPATH": env["PYTHONPATH"]}
        ports = (7100, 7101, 7102)
        cluster = {"ps": [f"{self.hosts[0].name}:{ports[0]}"],
                   "worker": [f"{self.hosts[1].name}:{ports[1]}", f"{self.hosts[2].name}:{ports[2]}"]}
        self.cluster_file = work / "cluster.json"
        self.cluster_file.write_text(json.dumps(cluster))
        self.procs = [self._start(i) for i in range(3)]

    def _start(self, i: int):
        job, index = _PLACES[i]
        proc = self.hosts.launch(self.hosts[i], self.cluster_file, job, index, self.job_argv, env=self.env,
                                 launch_flags=["--max-restarts", "1000", "--logdir", str(self.work / "logdir")])
        self.output.follow(proc.log)
        return proc

    def running(self) -> bool:
        return any(p.popen.poll() is None for p in self.procs)

    def targets(self) -> List[str]:
        return [f"/job:{job}/task:{index}" for job, index in _PLACES]

    def kill_task(self, task: str) -> bool:
        pid = self.output.pids().get(task)
        if pid is None:
            return False
        try:
            os.kill(pid, 9)
            return True
        except ProcessLookupError:
            return False

    def kill_host(self, task: str) -> bool:
        """Every process of the task's host dies (its launcher too); then its launcher starts again."""
        i = self.targets().index(task)
        if self.procs[i].popen.poll() is not None:
            return False
        self.procs[i].kill()
        self.procs[i] = self._start(i)
        return True

    def exit_code(self, timeout: float) -> int:
        codes = [p.popen.wait(timeout) for p in self.procs]
        return next((c for c in codes if c), 0)

    def close(self) -> None:
        self.hosts.close()
