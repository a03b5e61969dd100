"""Run `towerflow launch ...` from a test: output to a file, a hard deadline, everything killed on the way out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Sequence, Tuple

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
                before = os.fstat(out.fileno()).st_size
                _dump_stacks(proc, out)
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
        out.seek(0)
        data = out.buffer.read()
        text = data.decode(errors="replace")
    if timed_out:
        raise LaunchFailed(f"`towerflow launch {' '.join(args)}` still running after {timeout}s; where each task "
                           f"waited:\n{condensed_stacks(data[before:].decode(errors='replace'))}\nits output until then:\n"
                           f"{data[:before].decode(errors='replace')[-8000:]}")
    if proc.returncode != 0:
        raise LaunchFailed(f"`towerflow launch {' '.join(args)}` exited {proc.returncode}:\n{text[-8000:]}")
    return text


def _dump_stacks(proc: subprocess.Popen, out) -> None:
    """Have every task of a launch that ran past its deadline print its threads' stacks (the launcher passes
    SIGUSR1 on); returns once their output stops growing (at most 5 s)."""
    try:
        os.kill(proc.pid, signal.SIGUSR1)
    except ProcessLookupError:
        return
    size, deadline = -1, time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = os.fstat(out.fileno()).st_size
        if now == size:
            return
        size = now


def condensed_stacks(text: str, frames: int = 4) -> str:
    """The stack dumps in a launch's output (Python's faulthandler), each thread cut to its `frames` innermost
    frames outside Python's own library and the installed packages, file names without their folders; a
    thread with none (an idle pool thread, an event loop) is left out: what every task was doing, in a few lines."""
    kept: List[str] = []
    thread: List[str] = []

    def close() -> None:
        if len(thread) > 1:
            kept.extend(thread)
        thread.clear()

    for line in text.splitlines():
        prefix, _, rest = line.partition("] ") if line.startswith("[") else ("", "", line)
        body = rest.strip()
        if body.startswith(("Thread 0x", "Current thread 0x")):
            close()
            thread.append(f"{prefix}] {body.split(' (')[0]}:" if prefix else body.split(" (")[0] + ":")
        elif body.startswith("File ") and thread and len(thread) <= frames:
            where = body.split('"')
            if len(where) > 2 and f"{os.sep}lib{os.sep}python" not in where[1]:
                thread.append(f"    {os.path.basename(where[1])}{where[2]}")
    close()
    return "\n".join(kept) or "(no task printed its stacks)"


def run_by_hand(script: str, tasks: Sequence[Tuple[str, int]], flags: Sequence[str], extra: Sequence[str], timeout: float):
    """Start one process per (job, index) with the seeds' flags; returns {task: output}, raises LaunchFailed."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TOWERFLOW_") and k not in ("RANK", "WORLD_SIZE", "TF_CONFIG", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.path.join(REPO, "src") + os.pathsep + env.get("PYTHONPATH", "")
    procs = {}
    files = {}
    try:
        for job, index in tasks:
            name = f"{job}:{index}"
            files[name] = tempfile.TemporaryFile("w+")
            procs[name] = subprocess.Popen(
                [sys.executable, script, *flags, "--job_name", job, "--task_index", str(index), *extra],
                cwd=REPO, env=env, stdout=files[name], stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
            if any(p.poll() not in (None, 0) for p in procs.values()):
                break
            time.sleep(0.1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs.values():
            p.wait(10)
    outputs = {}
    for name, f in files.items():
        f.seek(0)
        outputs[name] = f.read()
        f.close()
    if any(p.returncode != 0 for p in procs.values()):
        report = "\n".join(f"--- {n} rc={procs[n].returncode}\n{o[-3000:]}" for n, o in outputs.items())
        raise LaunchFailed(f"{script} by hand did not finish cleanly within {timeout}s:\n{report}")
    return outputs
