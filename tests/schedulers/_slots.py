"""What the launch-under-a-scheduler tests share: the commands (absolute paths: a scheduler runs its tasks in
its own folder), each slot's `SLOT {json}` line (_slot_task.py) and the chief's test accuracy."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent.parent
SLOT_TASK = str(Path(__file__).resolve().parent / "_slot_task.py")
DATA = str((REPO / ".." / "shared" / "data" / "mnist-t10k").resolve())
MNIST_PS = str(REPO / "examples" / "mnist_ps.py")
MNIST_SYNC = str(REPO / "examples" / "mnist_sync.py")
LAUNCH = [sys.executable, "-m", "towerflow", "launch"]
CLUSTER = [sys.executable, "-m", "towerflow", "cluster"]


def task_env(**extra: str) -> Dict[str, str]:
    """What every task needs besides the scheduler's variables: this checkout's towerflow, short timeouts."""
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "TOWERFLOW_JOIN_TIMEOUT": "60", "OMP_NUM_THREADS": "1", **extra}


def slots(stdout: str) -> List[dict]:
    """Every `SLOT {...}` (a launched task's prefix before it, if any), chief first, then by job and index."""
    decoder, found, at = json.JSONDecoder(), [], stdout.find("SLOT {")
    while at >= 0:  # two processes on one pipe (torchrun) may interleave their lines
        found.append(decoder.raw_decode(stdout, at + len("SLOT "))[0])
        at = stdout.find("SLOT {", at + 1)
    return sorted(found, key=lambda s: (not s["chief"], s["job"], s["index"]))


def accuracy(text: str) -> float:
    found = re.findall(r"test accuracy: (\d\.\d{4})", text)
    assert len(found) == 1, f"expected one chief's test accuracy:\n{text[-4000:]}"
    return float(found[0])


def cluster_jsons(stdout: str) -> List[dict]:
    """`towerflow cluster --json` from every rank: one JSON object per rank, in any order. Read as a stream of
    objects, not of lines: mpirun forwards each rank's line whole but sometimes puts the next rank's before its
    newline (two objects on one line, seen on CI)."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(stdout) and stdout[at].isspace():
            at += 1
        if at == len(stdout):
            return sorted(objects, key=lambda o: o["rank"])
        obj, at = decoder.raw_decode(stdout, at)
        objects.append(obj)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_master_port(n: int) -> int:
    """A MASTER_PORT whose next n ports (the ranks', MASTER_PORT + 1 + r) and those + 10000 (the replicas'
    process group) are free now, below the ephemeral range so that no outgoing connection takes them meanwhile."""
    import random

    for _ in range(200):
        base = random.randrange(12000, 22000)
        ports = [base + i for i in range(n + 1)] + [base + 10000 + i for i in range(n + 1)]
        try:
            socks = []
            for p in ports:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no block of free ports in 12000-32000")


def still_running(pid: int) -> str:
    """What `pid` and its descendants are doing, one line each: state, kernel wait channel and the names of their
    threads (a process stuck at exit shows which native threads it still has)."""
    import psutil

    lines = []
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return "(nothing left)"
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/wchan") as f:
                wchan = f.read().strip()
            names = []
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                with open(f"/proc/{p.pid}/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            lines.append(f"pid {p.pid} ({' '.join(p.cmdline()[-2:])}): {p.status()}, waits in {wchan or '-'}, "
                         f"threads {sorted(names)}")
        except (psutil.NoSuchProcess, OSError):
            continue
    return "\n".join(lines)


def kill_tree(pid: int, grace: float = 5.0) -> None:
    """SIGTERM `pid` and every descendant (launchers stop their tasks on it), then SIGKILL what is left."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
