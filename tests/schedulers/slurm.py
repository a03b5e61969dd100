"""A real Slurm for the tests: munged, slurmctld and one slurmd per node, all under one temporary directory.

Nothing global is touched: the munge key, socket and log, slurm.conf, Slurm's state, spool, pid and log
files all live in `workdir`; srun, sbatch, sinfo, scancel and the daemons find the configuration through
`SLURM_CONF` (see `Slurm.env`). Ports are free ones, so two suites can share a machine.

Nodes are (name, address) pairs. On one machine that is the machine's own short hostname and 127.0.0.1;
with the network-namespace hosts of tests/multihost/netns.py each node is a namespace host, and `wrap`
runs a command on it (slurmctld on the first node; `srun` must run on a node as well, since the hosts'
bridge is not reachable from the machine's own network).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import psutil

ROOT = Path(__file__).resolve().parent.parent.parent
COMMANDS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "salloc", "sinfo", "squeue", "scancel")
INSTALL = "tools/install_schedulers.sh"  # installs them (as root with apt-get); `make test` runs it first
READY_TIMEOUT = 60  # seconds for every node to show idle in sinfo


@dataclass(frozen=True)
class Node:
    name: str
    address: str


Wrap = Callable[[Node, Sequence[str]], List[str]]


def _here(node: Node, argv: Sequence[str]) -> List[str]:
    return list(argv)


def on_netns_host(host, argv: Sequence[str]) -> List[str]:
    """argv on a namespace host of tests/multihost/netns.py: its network, hostname and /etc/hosts.

    Not `Host.command`: `ip netns exec` mounts a fresh /sys, where slurmd finds no cgroup filesystem
    ("No filesystem mounted on /sys/fs/cgroup ... slurmd initialization failed"); `nsenter --net`
    keeps the machine's /sys, and a private mount namespace carries the host's /etc/hosts.
    """
    return ["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", 'mount --bind "/etc/netns/$0/hosts" /etc/hosts && hostname "$0" && exec "$@"', host.name,
            *argv]


def missing(commands: Sequence[str]) -> List[str]:
    return [c for c in commands if shutil.which(c) is None]


def why_missing(commands: Sequence[str] = COMMANDS) -> Optional[str]:
    """Why the schedulers cannot run here (the commands not installed, and what installs them), or None.

    Only looks: installing is the setup's (`make test` runs tools/install_schedulers.sh before pytest).
    """
    lacking = missing(commands)
    if not lacking:
        return None
    return f"{', '.join(lacking)} not installed (as root with apt-get: bash {INSTALL}, which `make test` runs)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_cpus() -> int:
    """The CPUs slurmd finds here (`slurmd -C`): slurm.conf's CPUs= must be exactly this, or the node stays inval."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    for word in out.split():
        if word.startswith("CPUs="):
            return int(word[len("CPUs="):])
    return len(os.sched_getaffinity(0))


def short_hostname() -> str:
    return socket.gethostname().split(".")[0]


class Daemon:
    """A daemon in the foreground, in its own session, output in a log file."""

    def __init__(self, argv: Sequence[str], env: Dict[str, str], log: Path):
        self.argv, self.log = list(argv), log
        self.popen = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=log.open("wb"),
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, grace: float = 5.0) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


class Slurm:
    """munged + slurmctld + a slurmd per node; `close()` cancels every job and kills all it started."""

    def __init__(self, workdir: Path, nodes: Sequence[Node] = (), wrap: Wrap = _here, cpus: Optional[int] = None):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.nodes = list(nodes) or [Node(short_hostname(), "127.0.0.1")]
        self.wrap = wrap
        self.cpus = cpus or node_cpus()
        self.daemons: List[Daemon] = []
        self.startup_s: Dict[str, float] = {}
        self.conf = workdir / "slurm.conf"
        self.munge_socket = workdir / "munge" / "munge.socket.2"
        if len(str(workdir)) > 64:  # munged's and slurmd's sockets live under it: 108 bytes at most
            raise RuntimeError(f"Slurm's work directory {str(workdir)!r} is too long for Unix socket paths "
                               f"below it; use a shorter --basetemp")
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # --- the environment every Slurm command needs --------------------------------------------

    def env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """This machine's environment without any Slurm/MPI job of its own, SLURM_CONF pointing at ours."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "OMPI_", "PMI_", "PMIX_"))}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def run(self, argv: Sequence[str], timeout: float = 60, node: Optional[Node] = None,
            env: Optional[Dict[str, str]] = None, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command (srun, sbatch, sinfo, ...) on `node` (the first by default), hard time limit."""
        argv = self.wrap(node or self.nodes[0], argv)
        try:
            done = subprocess.run(argv, env=self.env(env), capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, cwd=str(self.workdir))
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{argv} still running after {timeout} s\n{self.describe()}\n"
                                 f"stdout: {e.stdout}\nstderr: {e.stderr}") from None
        if check and done.returncode != 0:
            raise AssertionError(f"{argv} exited {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr}\n"
                                 f"{self.describe()}")
        return done

    def describe(self) -> str:
        """The daemons' logs (their tails), for a failing test's report."""
        parts = []
        for d in self.daemons:
            parts.append(f"--- {d.log.name} ({'running' if d.alive() else f'exited {d.popen.returncode}'}) ---\n"
                         f"{d.output()[-3000:]}")
        for log in sorted(self.workdir.glob("log/*.log")):
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    # --- start and stop -------------------------------------------------------------------

    def _start(self) -> None:
        t0 = time.monotonic()
        self._start_munge()
        self.startup_s["munged"] = time.monotonic() - t0
        self._write_conf()
        t1 = time.monotonic()
        env = self.env()
        ctl = self.nodes[0]
        self.daemons.append(Daemon(self.wrap(ctl, ["slurmctld", "-D", "-i"]), env, self.workdir / "slurmctld.out"))
        for n in self.nodes:
            self.daemons.append(Daemon(self.wrap(n, ["slurmd", "-D", "-N", n.name]), env,
                                       self.workdir / f"slurmd-{n.name}.out"))
        self._wait_idle()
        self.startup_s["slurm"] = time.monotonic() - t1

    def _start_munge(self) -> None:
        d = self.workdir / "munge"
        d.mkdir()
        d.chmod(0o755)  # munged wants the socket's directory searchable by all
        key = d / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.munge_log = d / "munged.log"
        self.daemons.append(Daemon(["munged", "--foreground", "--force", f"--key-file={key}",
                                    f"--socket={self.munge_socket}", f"--pid-file={d / 'munged.pid'}",
                                    f"--log-file={self.munge_log}", f"--seed-file={d / 'munged.seed'}"],
                                   self.env(), self.workdir / "munged.out"))
        deadline = time.monotonic() + 20
        while not self.munge_socket.exists():
            if not self.daemons[-1].alive() or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.describe()}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        w = self.workdir
        for sub in ("state", "spool", "log", *(f"spool/{n.name}" for n in self.nodes)):
            (w / sub).mkdir()
        ctl = self.nodes[0]
        nodes = "\n".join(f"NodeName={n.name} NodeAddr={n.address} CPUs={self.cpus} State=UNKNOWN"
                          for n in self.nodes)
        self.conf.write_text(f"""\
# written by tests/schedulers/slurm.py for one test session
ClusterName=towerflow
SlurmctldHost={ctl.name}({ctl.address})
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool/%n
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/spool/slurmd-%n.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
InactiveLimit=0
KillWait=2
MinJobAge=5
SlurmctldTimeout=30
SlurmdTimeout=30
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
""")

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        states = ""
        while time.monotonic() < deadline:
            dead = [d for d in self.daemons if not d.alive()]
            if dead:
                raise RuntimeError(f"{dead[0].argv} exited {dead[0].popen.returncode}:\n{self.describe()}")
            done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=20, check=False)
            states = done.stdout.strip()
            idle = {line.split()[0] for line in states.splitlines() if line.split()[1:] == ["idle"]}
            if idle >= {n.name for n in self.nodes}:
                return
            time.sleep(0.3)
        raise RuntimeError(f"Slurm nodes not idle after {READY_TIMEOUT} s (sinfo: {states!r}):\n{self.describe()}")

    def _ours(self) -> List[psutil.Process]:
        """Processes started for this Slurm: the daemons, their descendants, and whatever carries our SLURM_CONF."""
        found: Dict[int, psutil.Process] = {}
        for d in self.daemons:
            try:
                p = psutil.Process(d.popen.pid)
                for q in [p, *p.children(recursive=True)]:
                    found[q.pid] = q
            except psutil.NoSuchProcess:
                pass
        for p in psutil.process_iter():
            try:
                if p.pid not in found and p.environ().get("SLURM_CONF") == str(self.conf):
                    found[p.pid] = p
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
                pass
        return [p for p in found.values() if p.pid != os.getpid()]

    def close(self) -> List[str]:
        """scancel every job, stop the daemons (slurmd, slurmctld, munged), kill what is left; returns leftovers."""
        if any(d.alive() for d in self.daemons[1:]):
            self.run(["scancel", "--full", "--quiet", "--user", "root"], timeout=20, check=False)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                q = self.run(["squeue", "-h", "-o", "%i"], timeout=20, check=False)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.3)
        started = self._ours()
        for d in reversed(self.daemons):  # slurmd before slurmctld before munged
            d.stop()
        for p in started:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(started, timeout=10)
        left = []
        for p in self._ours():
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {' '.join(p.cmdline())}")
            except psutil.NoSuchProcess:
                pass
        return left
