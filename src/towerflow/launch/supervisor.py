"""Run the task processes of one machine: prefix their output, stop them all when one fails.

Each task runs in its own session (so Ctrl-C reaches the launcher, which then stops every
task, and a task's own children are stopped with it) and, on Linux, dies with the launcher
(PR_SET_PDEATHSIG), so no process outlives a launch.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Deque, Dict, List, Optional, Sequence, TextIO

STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long
# "task": restart the task that died (parameter servers: the others go on without it);
# "group": restart every task (all-reduce replicas cannot go on without one of theirs)
RESTART_SCOPES = ("task", "group")
_TAIL_LINES = 20

try:
    _libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover
    _libc = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _libc is not None:
        _libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclasses.dataclass
class TaskProcessSpec:
    """What to run for one task and the variables it gets on top of the launcher's environment."""

    job: str
    index: int
    argv: List[str]
    env: Dict[str, str]

    @property
    def label(self) -> str:
        return f"{self.job}:{self.index}"

    @property
    def name(self) -> str:
        return f"/job:{self.job}/task:{self.index}"


class _Running:
    def __init__(self, spec: TaskProcessSpec, restarts: int, out: TextIO, err: TextIO, lock: threading.Lock,
                 max_restarts: int = 0):
        # every task learns how many restarts are allowed: peers of a silent task wait that long for it
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1", "TOWERFLOW_MAX_RESTARTS": str(max_restarts)}
        self.spec = spec
        self.restarts = restarts
        self.tail: Deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.proc = subprocess.Popen(
            spec.argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if _libc is not None else None,
        )
        self.threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, out, lock, False), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, err, lock, True), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _pump(self, stream, sink: TextIO, lock: threading.Lock, keep: bool) -> None:
        prefix = f"[{self.spec.label}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if keep:
                self.tail.append(line)
            with lock:
                try:
                    sink.write(prefix + line + "\n")
                    sink.flush()
                except (OSError, ValueError):  # our own output is gone (a closed pipe): keep draining the task's
                    pass
        stream.close()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def finish_output(self, timeout: float = 2.0) -> None:
        for t in self.threads:
            t.join(timeout)


@dataclasses.dataclass
class TaskFailure:
    """The first task that failed: what a user needs to find the root cause."""

    name: str
    pid: int
    host: str
    exit_code: int
    stderr_tail: List[str]

    def describe(self) -> str:
        how = f"was killed by signal {-self.exit_code}" if self.exit_code < 0 else f"exited with code {self.exit_code}"
        text = f"{self.name} (pid {self.pid} on {self.host}) failed first: it {how}."
        if self.stderr_tail:
            text += "\nLast lines of its stderr:\n  " + "\n  ".join(self.stderr_tail)
        return text


class Supervisor:
    """Start the tasks, wait for them all, and on the first failure (after restarts) stop the rest."""

    def __init__(
        self,
        tasks: Sequence[TaskProcessSpec],
        max_restarts: int = 0,
        out: Optional[TextIO] = None,
        err: Optional[TextIO] = None,
        restart_scope: str = "task",
    ):
        if restart_scope not in RESTART_SCOPES:
            raise ValueError(f"restart_scope={restart_scope!r}: expected one of {RESTART_SCOPES}")
        self.tasks = list(tasks)
        self.max_restarts = max_restarts
        self.restart_scope = restart_scope
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.failure: Optional[TaskFailure] = None
        self._lock = threading.Lock()
        self._running: List[_Running] = []

    def _say(self, text: str) -> None:
        with self._lock:
            self.err.write(f"towerflow launch: {text}\n")
            self.err.flush()

    def run(self) -> int:
        """Exit code: 0 when every task exited 0; the failed task's code (or 128+signal); 130 on Ctrl-C."""
        previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _raise_interrupt)
            # Ctrl-C stops the job even when the launch was started in the background of a
            # script (which starts it with SIGINT ignored)
            signal.signal(signal.SIGINT, _raise_interrupt)
        try:
            self._running = [_Running(t, 0, self.out, self.err, self._lock, self.max_restarts) for t in self.tasks]
            if self.max_restarts:  # restartable tasks: say which process is which (to watch them, or to test a kill)
                self._say("started " + ", ".join(f"{r.spec.name} (pid {r.proc.pid})" for r in self._running))
            return self._watch()
        except KeyboardInterrupt:
            self._say("interrupted; stopping every task")
            self.stop_all()
            return 130
        finally:
            self.stop_all()
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, previous[0])
                signal.signal(signal.SIGINT, previous[1])

    def _watch(self) -> int:
        while True:
            codes = [r.proc.poll() for r in self._running]
            if all(c == 0 for c in codes):
                for r in self._running:
                    r.finish_output()
                return 0
            # A task killed by a signal usually caused the others' errors (a collective whose peer
            # vanished): when several are seen at once, it is the one to report and act on.
            failed = sorted((i for i, c in enumerate(codes) if c not in (None, 0)), key=lambda i: codes[i] >= 0)
            for i in failed:
                r, code = self._running[i], codes[i]
                r.finish_output()
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                if r.restarts >= self.max_restarts:
                    return self._fail(r, code)
                if self.restart_scope == "group":
                    self._restart_all(r, how)
                    break
                self._running[i] = self._restart(r)
                self._say(f"{r.spec.name} (pid {r.proc.pid}) {how}; restarting it ({r.restarts + 1} of "
                          f"{self.max_restarts}) as pid {self._running[i].proc.pid}")
            time.sleep(0.05)

    def _fail(self, r: _Running, code: int) -> int:
        """No restarts left: stop the others, say who failed first, and return the launch's exit code."""
        self.failure = TaskFailure(r.spec.name, r.proc.pid, socket.gethostname(), code, list(r.tail))
        others = [o for o in self._running if o is not r and o.proc.poll() is None]
        self.stop_all()
        self._say(self.failure.describe() + (f"\nStopped the other {len(others)} running task(s)." if others else ""))
        return code if 0 < code < 256 else 128 + (-code if code < 0 else 1)

    def _restart(self, r: _Running, count: Optional[int] = None) -> _Running:
        """Start task r again as its restart number `count` (default: its own next one)."""
        count = r.restarts + 1 if count is None else count
        env = {**r.spec.env, "TOWERFLOW_RESTART_COUNT": str(count), "TOWERFLOW_RESTARTED_AT": repr(time.time())}
        return _Running(dataclasses.replace(r.spec, env=env), count, self.out, self.err, self._lock, self.max_restarts)

    def _restart_all(self, failed: _Running, how: str) -> None:
        """Stop every task and start them all again (each resumes from the newest checkpoint)."""
        count = failed.restarts + 1
        self._say(f"{failed.spec.name} (pid {failed.proc.pid}) {how}; restarting all {len(self._running)} tasks "
                  f"({count} of {self.max_restarts}): all-reduce replicas cannot go on without it")
        self.stop_all()
        self._running = [self._restart(r, count) for r in self._running]
        self._say("started " + ", ".join(f"{r.spec.name} (pid {r.proc.pid})" for r in self._running))

    def stop_all(self) -> None:
        """SIGTERM every task's process group, SIGKILL what is left after STOP_GRACE_S; waits for all."""
        alive = [r for r in self._running if r.proc.poll() is None]
        for r in alive:
            r.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for r in alive:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for r in self._running:
            r.signal_group(signal.SIGKILL)  # also reaps anything the task left in its group
            if r.proc.poll() is None:
                r.proc.kill()
            try:
                r.proc.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
            r.finish_output(0.5)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
