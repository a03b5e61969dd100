"""A real etcd cluster for the tests: members on loopback ports or on namespace hosts, each a
process the test kills at the end (and may kill mid-run: a lost member).

etcd comes from the Debian package `etcd-server`, which tools/install_schedulers.sh installs
(`make test` runs it before pytest); where it is missing, `unavailable()` says why to skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

READY_TIMEOUT = 30  # seconds for the members to elect a leader and answer


def unavailable() -> Optional[str]:
    """Why etcd cannot run here, or None. Only looks: installing is the setup's."""
    if shutil.which("etcd") is None:
        return ("etcd is not installed (as root with apt-get: bash tools/install_schedulers.sh, "
                "which `make test` runs)")
    return None


def member_argv(name: str, host: str, client_port: int, peer_port: int, cluster: str, data_dir: Path,
                token: str) -> List[str]:
    """One member of a new cluster (`cluster`: name=peer-url,...; `token` the same for all its members), its data
    in `data_dir`."""
    url = f"[{host}]" if ":" in host else host
    return ["etcd", "--name", name, "--data-dir", str(data_dir),
            "--listen-client-urls", f"http://{url}:{client_port}", "--advertise-client-urls", f"http://{url}:{client_port}",
            "--listen-peer-urls", f"http://{url}:{peer_port}", "--initial-advertise-peer-urls", f"http://{url}:{peer_port}",
            "--initial-cluster", cluster, "--initial-cluster-state", "new", "--initial-cluster-token", token,
            "--log-level", "warn", "--logger", "zap"]


def wait_ready(endpoints: Sequence[Tuple[str, int]], timeout: float = READY_TIMEOUT,
               alive: Optional[Callable[[], Optional[str]]] = None) -> None:
    """Poll until a member answers with a leader (a write goes through); AssertionError with why after `timeout`."""
    from towerflow.cluster.store.etcd import EtcdClient

    client = EtcdClient(endpoints, deadline=1.0)
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        if alive is not None and alive():
            raise AssertionError(f"an etcd member exited: {alive()}")
        try:
            client.put(b"/towerflow-test/ready", b"1")
            return
        except Exception as e:  # not up, or no leader yet
            last = e
        time.sleep(0.1)
    raise AssertionError(f"etcd at {endpoints} not ready within {timeout} s: {last}")


class LocalEtcd:
    """`n` members on 127.0.0.1 with the given free ports (2 per member), data on tmpfs; `close()` kills all."""

    def __init__(self, n: int, ports: Sequence[int]):
        self.dir = Path(tempfile.mkdtemp(prefix="towerflow-etcd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        tag = f"t{os.getpid()}x{ports[0]}"
        self.endpoints = [("127.0.0.1", ports[2 * i]) for i in range(n)]
        peers = [("127.0.0.1", ports[2 * i + 1]) for i in range(n)]
        cluster = ",".join(f"{tag}-{i}=http://{h}:{p}" for i, (h, p) in enumerate(peers))
        self.procs: List[subprocess.Popen] = []
        try:
            for i in range(n):
                log = (self.dir / f"member{i}.log").open("wb")
                argv = member_argv(f"{tag}-{i}", "127.0.0.1", self.endpoints[i][1], peers[i][1], cluster,
                                   self.dir / f"m{i}", tag)
                self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                   start_new_session=True))
            wait_ready(self.endpoints, alive=self._exited)
        except BaseException:
            self.close()
            raise

    def _exited(self) -> Optional[str]:
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                return f"member {i} exited with {p.returncode}: {self.log(i)[-2000:]}"
        return None

    def log(self, i: int) -> str:
        return (self.dir / f"member{i}.log").read_text(errors="replace")

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def close(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        shutil.rmtree(self.dir, ignore_errors=True)
