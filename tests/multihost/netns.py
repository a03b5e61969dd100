"""Several hosts on one machine: network namespaces on a bridge, as a user's separate machines.

Each host has its own network stack with one address on a private bridge, its own hostname
(a UTS namespace per process), and an /etc/hosts where its own name maps to 127.0.0.1 (as
Debian and Ubuntu ship) and the other hosts' names to their bridge addresses (as DNS would).
The bridge lives in a namespace of its own, so nothing here touches the machine's network:
traffic goes only between the hosts this harness makes. Needs root and `ip netns`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent.parent


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def unavailable() -> Optional[str]:
    """Why network-namespace hosts cannot be made here, or None when they can."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs `ip` (iproute2) and `unshare` (util-linux)"
    if os.geteuid() != 0:
        return "network-namespace hosts need root"
    probe = f"tfprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` is refused here: {getattr(e, 'stderr', '') or e}".strip()
    _ip("netns", "del", probe)
    return None


class Host:
    """One machine: a network namespace with an IPv4 and an IPv6 address, a hostname and an /etc/hosts."""

    def __init__(self, name: str, address: str, address6: str, netns: str):
        self.name, self.address, self.address6, self.netns = name, address, address6, netns

    def command(self, argv: Sequence[str]) -> List[str]:
        """argv run on this host: in its network namespace, with its hostname and /etc/hosts."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *argv]

    def link(self, up: bool) -> None:
        """Plug or unplug this host's network cable."""
        _ip("-n", self.netns, "link", "set", "eth0", "up" if up else "down")


class Proc:
    """A process started on a host, in its own session, output in a file."""

    def __init__(self, host: Host, argv: Sequence[str], env: Dict[str, str], log: Path):
        self.host, self.log = host, log
        self.popen = subprocess.Popen(host.command(argv), env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL,
                                      stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.log.name} on {self.host.name} still running after {timeout} s:\n"
                                 f"{self.output[-4000:]}") from None

    def kill(self) -> None:
        """SIGKILL to every process of its session (the launcher and its tasks)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass


class Hosts:
    """N hosts on one bridge; `close()` kills what was started on them and removes them."""

    def __init__(self, n: int, workdir: Path):
        self.tag = secrets.token_hex(2)  # names unique per run: two suites may share a machine
        self.workdir = workdir
        self.switch = f"tfsw{self.tag}"
        subnet = 10 + int(self.tag, 16) % 200
        self.hosts = [Host(f"tfh{self.tag}-{i}", f"10.213.{subnet}.{i + 1}", f"fd00:213:{subnet:x}::{i + 1}",
                           f"tfh{self.tag}-{i}") for i in range(n)]
        self.procs: List[Proc] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts):
            _ip("netns", "add", h.netns)
            veth = f"tfv{self.tag}{i}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _ip("link", "set", veth, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", veth, "master", "br0")
            _ip("-n", self.switch, "link", "set", veth, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.netns, "addr", "add", f"{h.address6}/64", "dev", "eth0", "nodad")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            lines = [f"127.0.0.1\tlocalhost {h.name}"] + [f"{o.address}\t{o.name}" for o in self.hosts if o is not h]
            (etc / "hosts").write_text("\n".join(lines) + "\n")

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def start(self, host: Host, argv: Sequence[str], label: str, env: Optional[Dict[str, str]] = None) -> Proc:
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("TOWERFLOW_", "TF_CONFIG", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "GLOO_",
                                     "TP_", "NCCL_"))}
        base["PYTHONUNBUFFERED"] = "1"
        base["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), base.get("PYTHONPATH", "")])
        # each host's task would take every core of the machine, which the hosts share: one thread each
        base["OMP_NUM_THREADS"] = "1"
        proc = Proc(host, argv, {**base, **(env or {})}, self.workdir / f"{label}.log")
        self.procs.append(proc)
        return proc

    def launch(self, host: Host, cluster_file: Path, job: str, index: int, script_argv: Sequence[str],
               env: Optional[Dict[str, str]] = None, launch_flags: Sequence[str] = ()) -> Proc:
        """`towerflow launch --cluster FILE --job_name J --task_index I SCRIPT ...` on `host`."""
        argv = [sys.executable, "-m", "towerflow", "launch", "--cluster", str(cluster_file), "--job_name", job,
                "--task_index", str(index), *launch_flags, *script_argv]
        return self.start(host, argv, f"{job}{index}-{len([p for p in self.procs if p.host is host])}", env)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        for h in self.hosts:
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True, timeout=20)
            shutil.rmtree(Path("/etc/netns") / h.netns, ignore_errors=True)
        subprocess.run(["ip", "netns", "del", self.switch], capture_output=True, timeout=20)

