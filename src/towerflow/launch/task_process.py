"""One task process of a launch: what to run (TaskProcessSpec) and the process running it (TaskProcess).

The process runs in its own session and, on Linux, dies with the launcher (PR_SET_PDEATHSIG); it is
forked from the launch's fork server when there is one, else a fresh interpreter. Its output is
prefixed with its label, and transport warnings are held a moment (`release_held`), since they are
usually another task's failure seen from here.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, TextIO, Tuple

from towerflow.launch import environment as _env
from towerflow.launch import forkserver as _forks
from towerflow.launch import verdict as _verdict

_HOLD_S = 3.0  # how long a transport warning waits for a failure to become known before it is printed

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
    unset: Tuple[str, ...] = ()  # variables of the launcher's environment this task must not inherit
    serves_only: bool = False  # it only serves the other tasks (a ps running the launcher's ps program)

    @property
    def label(self) -> str:
        return f"{self.job}:{self.index}"

    @property
    def name(self) -> str:
        return f"/job:{self.job}/task:{self.index}"


class TaskProcess:
    """One running task process: its output pumped with a [job:index] prefix, its transport warnings held."""

    def __init__(self, spec: TaskProcessSpec, restarts: int, out: TextIO, err: TextIO, lock: threading.Lock,
                 max_restarts: int = 0, reports: str = "", failing: Callable[[], bool] = lambda: False,
                 forks: Optional[_forks.ForkServer] = None):
        self.report_path = os.path.join(reports, f"{spec.job}.{spec.index}.{restarts}.json")
        # every task learns how many restarts are allowed: peers of a silent task wait that long for it
        env = {**_env.inherited(spec.unset), **spec.env, "PYTHONUNBUFFERED": "1", _env.ENV_MAX_RESTARTS: str(max_restarts),
               _env.ENV_ERROR_FILE: self.report_path}
        # a task that crashes in native code (a segfault, an abort) prints its Python threads' stacks first
        env.setdefault("PYTHONFAULTHANDLER", "1")
        self.spec = spec
        self.restarts = restarts
        self.stopped = False  # the launcher stopped it
        self.lost = False  # out of restarts and left so: its part is served by a backup (Supervisor._lose)
        self.started_at = time.monotonic()
        self.logged = False  # its exit is in the run log (runlog.py)
        self.held: Deque[tuple] = collections.deque()  # (when, line): transport warnings not printed yet
        self.dropped = 0
        self._failing = failing
        self._lock = lock
        self._sink = err
        self.proc = spawn(spec.argv, env, forks, err)
        self.threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, out, lock, False), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, err, lock, True), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _pump(self, stream, sink: TextIO, lock: threading.Lock, is_stderr: bool) -> None:
        in_noise = False  # the lines after a transport warning: the C++ stack printed with it
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with lock:
                in_noise = is_stderr and (_verdict.is_transport_noise(line) or (in_noise and _verdict.continues_noise(line)))
                if in_noise:
                    self.held.append((time.monotonic(), line))
                else:
                    self._write(sink, line)
        stream.close()

    def _write(self, sink: TextIO, line: str) -> None:  # under the lock
        try:
            sink.write(f"[{self.spec.label}] {line}\n")
            sink.flush()
        except (OSError, ValueError):  # our own output is gone (a closed pipe): keep draining the task's
            pass

    def release_held(self, everything: bool = False) -> None:
        """Transport warnings held for _HOLD_S (or all, at the end): dropped once a task has failed
        (they are that failure's connections closing), printed otherwise."""
        with self._lock:
            while self.held and (everything or time.monotonic() - self.held[0][0] >= _HOLD_S):
                line = self.held.popleft()[1]
                if self._failing():
                    self.dropped += 1
                else:
                    self._write(self._sink, line)

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def finish_output(self, timeout: float = 2.0) -> None:
        for t in self.threads:
            t.join(timeout)
        self.release_held(everything=True)

    def end(self) -> _verdict.TaskEnd:
        return _verdict.TaskEnd(self.spec.name, self.proc.pid, self.proc.poll(), self.stopped, self.report_path)


def spawn(argv: List[str], env: Dict[str, str], forks: Optional[_forks.ForkServer], err: TextIO):
    """The task's process: forked from the launch's fork server when it has one and `argv` runs on this
    interpreter, else a fresh interpreter (also when the fork server fails, which is said)."""
    if forks is not None and forks.gone is None and _forks.forkable(argv):
        try:
            return forks.spawn(argv, env)
        except OSError as e:
            err.write(f"{_verdict.PREFIX}{e}; starting the tasks as fresh interpreters instead\n")
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_die_with_parent if _libc is not None else None)


def child_setup() -> Optional[Callable[[], None]]:
    """What a task's child process runs between fork and exec (die with the launcher), where the OS has it."""
    return _die_with_parent if _libc is not None else None
