"""A private stand-in for `towerflow launch` in tests: N replica processes on this host.

Each child gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port). Output goes to files (a full pipe cannot
block a child), every wait has a deadline, and every child is killed on the way out.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from towerflow.cluster.ports import PortReservation

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class ReplicaResult:
    rank: int
    returncode: Optional[int]  # None: killed by the helper
    stdout: str
    stderr: str


class ReplicasFailed(AssertionError):
    """The job did not finish cleanly; the message holds every replica's output."""


def describe(results: Sequence[ReplicaResult]) -> str:
    parts = []
    for r in results:
        parts.append(f"--- replica {r.rank} rc={r.returncode}\n[stdout]\n{r.stdout[-3000:]}\n[stderr]\n{r.stderr[-5000:]}")
    return "\n".join(parts)


def run_replicas(
    argv: Sequence[str],
    n: int,
    timeout: float = 90.0,
    env: Optional[Dict[str, str]] = None,
    kill_on_failure: bool = True,
    check: bool = True,
) -> List[ReplicaResult]:
    """Run `python *argv` as n replicas; with `check`, raise ReplicasFailed unless all exit 0."""
    held = PortReservation(1)  # until the replicas are done: their store's port stays theirs
    port = held.ports[0]
    tmp = tempfile.mkdtemp(prefix="towerflow-replicas-")
    procs, files = [], []
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TF_CONFIG", "TOWERFLOW_DEVICE")}
    base.setdefault("PYTHONPATH", os.path.join(REPO, "src"))
    base.setdefault("PYTHONFAULTHANDLER", "1")  # as `towerflow launch` gives its tasks: a native crash shows its stacks
    try:
        for rank in range(n):
            child_env = {
                **base,
                "RANK": str(rank),
                "WORLD_SIZE": str(n),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(n),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                **(env or {}),
            }
            out = open(os.path.join(tmp, f"{rank}.out"), "w+")
            err = open(os.path.join(tmp, f"{rank}.err"), "w+")
            files.append((out, err))
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv], env=child_env, stdout=out, stderr=err, cwd=REPO, start_new_session=True
                )
            )
        deadline = time.monotonic() + timeout
        timed_out = False
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            if (failed and kill_on_failure) or time.monotonic() > deadline:
                timed_out = not failed
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=10)
        held.release()
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0)
        err.seek(0)
        results.append(ReplicaResult(rank, p.returncode if p.returncode >= 0 else None, out.read(), err.read()))
        out.close()
        err.close()
    if timed_out:
        raise ReplicasFailed(f"replicas still running after {timeout}s:\n{describe(results)}")
    if check and any(r.returncode != 0 for r in results):
        raise ReplicasFailed(f"a replica failed:\n{describe(results)}")
    return results
