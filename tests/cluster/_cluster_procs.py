"""Helpers for multi-process tests: free ports, processes in their own sessions, polling with deadlines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


class Proc:
    """A started process with its output in files (no pipe can fill up and block it)."""

    def __init__(self, argv: List[str], env: Dict[str, str], tmp: Path, label: str):
        self.label = label
        self.out_path = tmp / f"{label}.out"
        self.err_path = tmp / f"{label}.err"
        self.popen = subprocess.Popen(
            argv,
            env=env,
            stdout=self.out_path.open("wb"),
            stderr=self.err_path.open("wb"),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(ROOT),
        )

    @property
    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def err(self) -> str:
        return "\n".join(l for l in self.err_path.read_text(errors="replace").splitlines() if not l.startswith("[W"))

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.label} still running after {timeout} s\n{self.describe()}") from None

    def describe(self) -> str:
        return f"--- {self.label} stdout ---\n{self.out}\n--- {self.label} stderr ---\n{self.err[-6000:]}"

    def kill_group(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass

    def group_alive(self) -> bool:
        try:
            os.killpg(self.popen.pid, 0)
            return True
        except ProcessLookupError:
            return False


class Procs:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.started: List[Proc] = []

    def python(self, script: str, *args: str, env: Optional[Dict[str, str]] = None, label: Optional[str] = None) -> Proc:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERFLOW_", "TF_CONFIG", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
        base["PYTHONUNBUFFERED"] = "1"
        base["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(HERE), base.get("PYTHONPATH", "")])
        script = script if script.startswith("-") or os.path.isabs(script) or "/" in script else str(HERE / script)
        p = Proc([sys.executable, script, *args], {**base, **(env or {})}, self.tmp, label or f"p{len(self.started)}")
        self.started.append(p)
        return p

    def describe(self) -> str:
        return "\n".join(p.describe() for p in self.started)




def wait_until(condition, timeout: float, what: str, poll: float = 0.05):
    """Poll for a condition with a deadline (no sleep-and-hope)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"
