"""Run `towerflow launch ...` from a test: output to a file, a hard deadline, everything killed on the way out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LaunchFailed(AssertionError):
    """The launched job failed or ran past its deadline; the message holds every task's output."""


def launch(args: Sequence[str], timeout: float) -> str:
    """`python -m towerflow launch *args`; returns the combined (task-prefixed) output, or raises LaunchFailed."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TF_CONFIG", "TOWERFLOW_DEVICE")}
    env["PYTHONPATH"] = os.path.join(REPO, "src") + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "towerflow", "launch", *args],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            timed_out = proc.poll() is None
            if timed_out:  # the launcher stops its tasks on SIGTERM; they also die with it
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        out.seek(0)
        text = out.read()
    if timed_out:
        raise LaunchFailed(f"`towerflow launch {' '.join(args)}` still running after {timeout}s:\n{text[-8000:]}")
    if proc.returncode != 0:
        raise LaunchFailed(f"`towerflow launch {' '.join(args)}` exited {proc.returncode}:\n{text[-8000:]}")
    return text
