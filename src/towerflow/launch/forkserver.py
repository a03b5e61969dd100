"""Start task processes by forking one that has imported torch already (a fork server).

A task process spends 3-4 s of a core importing torch before its first line runs: a launch of five
tasks on two cores waits about ten seconds for that, and every restart of a killed task waits for it
again. The launcher instead starts one zygote (`zygote.py`), which imports torch once and forks a task
for each request. The child sets up what a fresh interpreter would have (the task's environment,
arguments, working directory, output pipes, its own session, death with its parent) and runs the script
or module as `python` does. The zygote stays single-threaded so that forking it is safe, never touches
CUDA, and reports each child's exit; `ForkedProcess` stands in for `subprocess.Popen` in the supervisor.

Only `[sys.executable, SCRIPT, ...]` and `[sys.executable, -m, MODULE, ...]` are forked; anything else
(another interpreter, `-c`, interpreter flags) is started as before. `TOWERFLOW_FORK_SERVER=0` turns
it off; docs/cluster.md says what differs from a fresh interpreter.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, Optional, Sequence, Tuple

from towerflow.launch import environment as _env

START_TIMEOUT_S = 300.0  # the zygote's first answer waits for its torch import, slow on a loaded machine
MAX_MESSAGE = 1 << 20
# Room for a task's command line and environment in the zygote's own (zygote._show_as writes them there)
ARGV_ROOM, ENV_ROOM = 4096, 65536
ENV_ROOM_VAR = "TOWERFLOW_ZYGOTE_ROOM"


@dataclasses.dataclass(frozen=True)
class ForkRequest:
    """Run `argv` (the interpreter first) with exactly `env`, in `cwd`; stdin, stdout and stderr come as fds."""

    argv: Tuple[str, ...]
    env: Dict[str, str]
    cwd: str


@dataclasses.dataclass(frozen=True)
class Forked:
    pid: int


@dataclasses.dataclass(frozen=True)
class ForkFailed:
    error: str


@dataclasses.dataclass(frozen=True)
class Exited:
    """A forked task ended; `returncode` as Popen gives it (negative: killed by that signal)."""

    pid: int
    returncode: int


def forkable(argv: Sequence[str]) -> bool:
    """Whether `argv` runs a script or a module on this interpreter with no interpreter flags."""
    if len(argv) < 2 or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return False
    if argv[1] == "-m":
        return len(argv) >= 3 and not argv[2].startswith("-")
    return not argv[1].startswith("-")


class ForkServer:
    """The launcher's end: starts the zygote, asks it for tasks, and keeps the exit codes it reports."""

    def __init__(self, die_with_parent=None):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "towerflow.launch.zygote", str(theirs.fileno()), " " * ARGV_ROOM],
                env={**_env.inherited(), ENV_ROOM_VAR: " " * ENV_ROOM}, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent)
        finally:
            theirs.close()
        self._sock = ours
        self._ask = threading.Lock()  # one request and its answer at a time
        self._answers: "queue.Queue[object]" = queue.Queue()
        self._ended = threading.Condition()
        self._exits: Dict[int, int] = {}
        self.gone: Optional[str] = None  # why the zygote no longer answers
        threading.Thread(target=self._read, name="towerflow-forkserver", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError as e:
                data, why = b"", str(e)
            else:
                why = "it exited"
            if not data:
                with self._ended:
                    self.gone = f"the fork server (pid {self._proc.pid}) is gone: {why}"
                    self._ended.notify_all()
                self._answers.put(ForkFailed(self.gone))
                return
            message = pickle.loads(data)
            if isinstance(message, Exited):
                with self._ended:
                    self._exits[message.pid] = message.returncode
                    self._ended.notify_all()
            else:
                self._answers.put(message)

    def spawn(self, argv: Sequence[str], env: Dict[str, str], cwd: Optional[str] = None) -> "ForkedProcess":
        """A task forked from the zygote, its stdout and stderr pipes to read; OSError when the zygote cannot."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        try:
            with self._ask:
                if self.gone:
                    raise OSError(self.gone)
                request = pickle.dumps(ForkRequest(tuple(argv), dict(env), cwd or os.getcwd()))
                socket.send_fds(self._sock, [request], [null, out_w, err_w])
                try:
                    answer = self._answers.get(timeout=START_TIMEOUT_S)
                except queue.Empty:  # a late answer would be taken for the next request's: ask it nothing more
                    self.gone = f"the fork server (pid {self._proc.pid}) did not answer within {START_TIMEOUT_S:g} s"
                    raise OSError(self.gone) from None
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            for fd in (out_w, err_w, null):
                os.close(fd)
        if not isinstance(answer, Forked):
            os.close(out_r)
            os.close(err_r)
            self.gone = self.gone or getattr(answer, "error", repr(answer))  # it will not fork any other either
            raise OSError(self.gone)
        return ForkedProcess(self, answer.pid, argv, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))

    def returncode(self, pid: int, timeout: Optional[float] = 0.0) -> Optional[int]:
        """`pid`'s exit code once the zygote reported it, waiting up to `timeout` s (None: for ever)."""
        with self._ended:
            self._ended.wait_for(lambda: pid in self._exits or self.gone is not None, timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """Stop the zygote (its tasks are the supervisor's to stop first)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # close() alone would not end the reader thread's recv
            self._sock.close()
        except OSError:
            pass
        finally:
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


class ForkedProcess:
    """What the supervisor uses of a `subprocess.Popen`, for a task the zygote forked."""

    def __init__(self, server: ForkServer, pid: int, argv: Sequence[str], stdout, stderr):
        self._server = server
        self.pid = pid
        self.args = list(argv)  # as Popen.args: what a TimeoutExpired names
        self.stdout, self.stderr = stdout, stderr
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._code(0.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self._code(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _code(self, timeout: Optional[float]) -> Optional[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            code = self._server.returncode(self.pid, left)
            if code is not None or self._server.gone is None:
                return code
            # the zygote died before reporting it (PR_SET_PDEATHSIG ends the task then): from /proc while a zombie
            ended = _ended(self.pid)
            if ended is not None:
                return ended
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _ended(pid: int) -> Optional[int]:
    """The exit code of a process that is not our child: from /proc while it is a zombie, the parent-death
    signal's once it is gone; None while it runs."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return -signal.SIGTERM
    if fields[0] != b"Z":
        return None
    try:
        return os.waitstatus_to_exitcode(int(fields[52 - 3]))
    except (IndexError, ValueError):
        return -signal.SIGTERM
