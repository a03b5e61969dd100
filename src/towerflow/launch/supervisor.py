"""Run the task processes of one machine: prefix their output, stop them all when one fails.

Each task runs in its own session (so Ctrl-C reaches the launcher, which then stops every
task, and a task's own children are stopped with it) and, on Linux, dies with the launcher
(PR_SET_PDEATHSIG), so no process outlives a launch. Each task process gets its own
TOWERFLOW_ERROR_FILE, where it leaves a report if it fails; `verdict.py` turns the reports into
what the launcher says when the run fails.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO

from towerflow.launch import environment as _env
from towerflow.launch import forkserver as _forks
from towerflow.launch import runlog as _runlog
from towerflow.launch import verdict as _verdict
from towerflow.launch.task_process import TaskProcess, TaskProcessSpec, child_setup

STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long
# "task": restart the task that died (parameter servers: the others go on without it);
# "group": restart every task (all-reduce replicas cannot go on without one of theirs);
# "replicas": a chief or worker restarts every chief and worker, a ps task alone (hybrid: --dense allreduce)
RESTART_SCOPES = ("task", "group", "replicas")
EXITING_GRACE_S = 3.0  # how long a task that reported its own failure gets to exit by itself (_fail)
SERVE_GRACE_S = 5.0  # how long tasks that only serve others may outlive every task they serve (_served)
QUICK_FAILURE_S = 10.0  # a task failing sooner than this after its start, twice in a row, waits to be restarted
BACKOFF_S = (1.0, 15.0)  # that wait: the first, doubling on each quick failure after it up to the last


class Supervisor:
    """Start the tasks, wait for them all, and on the first failure (after restarts) stop the rest."""

    def __init__(
        self,
        tasks: Sequence[TaskProcessSpec],
        max_restarts: int = 0,
        out: Optional[TextIO] = None,
        err: Optional[TextIO] = None,
        restart_scope: str = "task",
        ps_replicas: int = 1,
    ):
        if restart_scope not in RESTART_SCOPES:
            raise ValueError(f"restart_scope={restart_scope!r}: expected one of {RESTART_SCOPES}")
        self.tasks = list(tasks)
        self.max_restarts = max_restarts
        self.restart_scope = restart_scope
        self.ps_replicas = ps_replicas  # >= 2: a ps task out of restarts leaves its part to its backup (_lose)
        self._quick: Dict[str, int] = {}  # task name: how many times in a row it failed within QUICK_FAILURE_S
        self._due: Dict[int, float] = {}  # index of a failed task: when its restart starts (_pause)
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.failure: Optional[_verdict.Verdict] = None
        self._lock = threading.Lock()
        self._running: List[TaskProcess] = []
        self._reports = ""  # a folder for the tasks' failure reports, for the length of run()
        self._failed = False  # a task process failed (it may have been restarted since)
        self._log = _runlog.RunLog.for_tasks([t.env for t in self.tasks])  # the run's state for `towerflow top`
        self._forks: Optional[_forks.ForkServer] = None  # for the length of run(), when it pays (_fork_server)
        self.launch_id = secrets.token_hex(8)  # every incarnation of these tasks carries it (cluster/membership/ending.py)

    def _say(self, text: str) -> None:
        with self._lock:
            self.err.write(f"{_verdict.PREFIX}{text}\n")
            self.err.flush()

    def run(self, hold: Optional[Callable[[], Any]] = None) -> int:
        """Exit code: 0 when every task exited 0; the failed task's code (or 128+signal); 130 on Ctrl-C.

        `hold` (the launcher's rendezvous store) is called once the tasks are started, so that its
        start-up (importing torch) overlaps theirs (the tasks wait for the store's port), or, with a fork
        server, before, overlapping the fork server's; what it returns is kept until the run ends. An
        error it raises stops every task and is raised here.
        """
        previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGUSR1)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._pass_on)  # every task prints its threads' stacks (cluster/server.py)
            signal.signal(signal.SIGTERM, _raise_interrupt)
            # Ctrl-C stops the job even when the launch was started in the background of a
            # script (which starts it with SIGINT ignored)
            signal.signal(signal.SIGINT, _raise_interrupt)
        self._reports = tempfile.mkdtemp(prefix="towerflow-launch-")
        code = 130
        try:
            self._forks = self._fork_server()
            self._log.run_start([_runlog.task_name(t.job, t.index) for t in self.tasks])
            held = None
            try:
                if self._forks is not None and hold is not None:
                    held = hold()  # while the fork server imports torch: the forked tasks then find the store at once
                self._running = [self._start(t, 0) for t in self.tasks]
                if self.max_restarts:  # restartable tasks: say which process is which (to watch them, or test a kill)
                    self._say("started " + ", ".join(f"{r.spec.name} (pid {r.proc.pid})" for r in self._running))
                if self._forks is None and hold is not None:
                    held = hold()
            except Exception:
                code = 2  # the run log says the launch failed, not that it was interrupted
                raise
            code = self._watch()
            del held
            return code
        except KeyboardInterrupt:
            self._say("interrupted; stopping every task")
            self.stop_all()
            return 130
        finally:
            self.stop_all()
            if self._forks is not None:
                self._forks.close()
            self._log_exits()
            self._log.run_end(code)
            shutil.rmtree(self._reports, ignore_errors=True)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, previous[0])
                signal.signal(signal.SIGINT, previous[1])
                signal.signal(signal.SIGUSR1, previous[2])

    def _fork_server(self) -> Optional[_forks.ForkServer]:
        """One fork server for the run (forkserver.py) when it saves torch imports: several Python tasks, or one
        that may be restarted; none under TOWERFLOW_FORK_SERVER=0."""
        pays = len(self.tasks) > 1 or self.max_restarts > 0
        if not (pays and _env.fork_server_wanted() and any(_forks.forkable(t.argv) for t in self.tasks)):
            return None
        try:
            return _forks.ForkServer(child_setup())
        except OSError as e:
            self._say(f"no fork server ({e}); every task starts as a fresh interpreter")
            return None

    def _pass_on(self, signum, frame) -> None:
        """SIGUSR1 to every task that catches it (one whose Server started); it would end one that does not."""
        for r in list(self._running):
            if r.proc.poll() is None and _catches(r.proc.pid, signum):
                r.proc.send_signal(signum)

    def _log_exits(self, only: Sequence[TaskProcess] = ()) -> None:
        for r in only or self._running:
            if not r.logged:
                r.logged = True
                self._log.task_exit(_runlog.task_name(r.spec.job, r.spec.index), r.proc.poll(), r.restarts, r.stopped)

    def _start(self, spec: TaskProcessSpec, restarts: int) -> TaskProcess:
        spec = dataclasses.replace(spec, env={**spec.env, _env.ENV_LAUNCH_ID: self.launch_id})
        return TaskProcess(spec, restarts, self.out, self.err, self._lock, self.max_restarts, self._reports, self._failing,
                        self._forks)

    def _failing(self) -> bool:
        """Whether a task has failed: a process exited non-zero, or one left a failure report (a task
        writes it before it closes any connection, so before the warnings its failure causes)."""
        try:
            return self._failed or any(n.endswith(".json") for n in os.listdir(self._reports))
        except OSError:  # the run is over and its folder gone
            return self._failed

    def _watch(self) -> int:
        served_at: Optional[float] = None  # when every task that trains had exited 0
        while True:
            for r in self._running:
                r.release_held()
            self._start_due()
            codes = [None if i in self._due else 0 if r.lost else r.proc.poll() for i, r in enumerate(self._running)]
            if all(c == 0 for c in codes):
                for r in self._running:
                    r.finish_output()
                return self._succeeded()
            if not self._served(codes):
                served_at = None
            elif served_at is None:
                served_at = time.monotonic()
            elif time.monotonic() - served_at > SERVE_GRACE_S:
                return self._stop_servers()
            # A task killed by a signal usually caused the others' errors (a collective whose peer
            # vanished): when several are seen at once, it is the one to report and act on.
            failed = sorted((i for i, c in enumerate(codes) if c not in (None, 0)), key=lambda i: codes[i] >= 0)
            for i in failed:
                r, code = self._running[i], codes[i]
                self._failed = True
                self._log_exits([r])
                r.finish_output()
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                if r.restarts >= self.max_restarts:
                    if not self._backed_up(r):
                        return self._fail(r)
                    self._lose(r, how)
                    continue
                if self.restart_scope == "group" or (self.restart_scope == "replicas" and r.spec.job != "ps"):
                    self._restart_all(r, how)
                    break
                pause = self._pause(r)
                if pause:
                    self._due[i] = time.monotonic() + pause
                    self._say(f"{r.spec.name} (pid {r.proc.pid}) {how}; restarting it ({r.restarts + 1} of "
                              f"{self.max_restarts}) in {pause:g} s: it failed within {QUICK_FAILURE_S:g} s of its start "
                              f"{self._quick[r.spec.name]} times in a row{_verdict.restart_note(r.report_path)}")
                    continue
                self._running[i] = self._restart(r)
                self._say(f"{r.spec.name} (pid {r.proc.pid}) {how}; restarting it ({r.restarts + 1} of "
                          f"{self.max_restarts}) as pid {self._running[i].proc.pid}{_verdict.restart_note(r.report_path)}")
            time.sleep(0.05)

    def _pause(self, r: TaskProcess) -> float:
        """Seconds before restarting r: none, unless it failed soon after its start again (a host cut off from the
        others, a script that fails at once), so that such failures do not spend every restart in seconds."""
        quick = time.monotonic() - r.started_at < QUICK_FAILURE_S
        n = self._quick[r.spec.name] = self._quick.get(r.spec.name, 0) + 1 if quick else 0
        return 0.0 if n < 2 else min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (n - 2))

    def _start_due(self) -> None:
        """Start the restarts whose pause is over."""
        for i, when in list(self._due.items()):
            if time.monotonic() >= when:
                del self._due[i]
                r = self._running[i]
                self._running[i] = self._restart(r)
                self._say(f"restarted {r.spec.name} ({r.restarts + 1} of {self.max_restarts}) as pid "
                          f"{self._running[i].proc.pid}")

    def _backed_up(self, r: TaskProcess) -> bool:
        """Whether a lost task's part may live on elsewhere: a ps task with a backup (--ps-replicas 2) while another
        ps task of this launch is left. Whether a backup holds it (a promoted part's own backup is seeded only once
        it is promoted) the workers learn, and they end the job when none does."""
        ps = [o for o in self._running if o.spec.job == "ps"]
        return r.spec.job == "ps" and self.ps_replicas >= 2 and sum(o.lost for o in ps) < len(ps) - 1

    def _lose(self, r: TaskProcess, how: str) -> None:
        """A ps task out of restarts whose backup holds its part: not restarted, and the job goes on (the
        workers promote the backup once the task's heartbeats have stopped)."""
        r.lost = True
        self._say(f"{r.spec.name} (pid {r.proc.pid}) {how}, with no restarts left ({self.max_restarts}); leaving it "
                  "lost: its backup takes its part over once the workers stop waiting for it (--ps-replicas "
                  f"{self.ps_replicas}){_verdict.restart_note(r.report_path)}")

    def _served(self, codes: Sequence[Optional[int]]) -> bool:
        """Whether every task that trains has exited 0 while some that only serve them still run."""
        trains = [c for r, c in zip(self._running, codes) if not r.spec.serves_only]
        serving = [c for r, c in zip(self._running, codes) if r.spec.serves_only]
        return bool(trains) and all(c == 0 for c in trains) and any(c is None for c in serving)

    def _stop_servers(self) -> int:
        """Every task that trains exited 0 and the ps tasks did not follow: they are waiting for tasks that will
        never join (a script that ended before it built its strategy, as with --help). Nothing is left to serve."""
        waiting = [r for r in self._running if r.proc.poll() is None]
        self._say(f"every training task exited 0 and {', '.join(r.spec.name for r in waiting)} still ran after "
                  f"{SERVE_GRACE_S:g} s (waiting for tasks that never joined the cluster, as when a script exits "
                  "before it builds its strategy, such as with --help; or stopped answering and another task stood "
                  "in for it); stopping it: nothing is left to serve")
        for r in waiting:
            r.stopped = True
        self.stop_all()
        return self._succeeded()

    def _succeeded(self) -> int:
        """Exit code 0; a ps task left lost on the way is said once more, as the run's last word."""
        lost = [r.spec.name for r in self._running if r.lost]
        if lost:
            self._say(f"every task that trains exited 0; {', '.join(lost)} had no restarts left and was left lost: "
                      f"its backup served its part (--ps-replicas {self.ps_replicas})")
        return 0

    def _fail(self, r: TaskProcess) -> int:
        """No restarts left: stop the others, say who failed first (verdict.py), return the exit code."""
        # A task that has written its failure report is on its way out: it gets EXITING_GRACE_S to
        # exit with its own code before it is stopped (else its own failure reads as a stop).
        deadline = time.monotonic() + EXITING_GRACE_S
        for o in self._running:
            if o is not r and o.proc.poll() is None and os.path.exists(o.report_path):
                try:
                    o.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for o in self._running:
            o.stopped = o.proc.poll() is None
        self.stop_all()
        for o in self._running:
            o.finish_output(0.5)
        dropped = sum(o.dropped for o in self._running)
        self.failure = _verdict.decide([o.end() for o in self._running], r.end(), socket.gethostname(), dropped)
        with self._lock:
            self.err.write(self.failure.text + "\n")
            self.err.flush()
        return self.failure.exit_code

    def _restart(self, r: TaskProcess, count: Optional[int] = None) -> TaskProcess:
        """Start task r again as its restart number `count` (default: its own next one)."""
        count = r.restarts + 1 if count is None else count
        env = {**r.spec.env, _env.ENV_RESTART_COUNT: str(count), _env.ENV_RESTARTED_AT: repr(time.time())}
        return self._start(dataclasses.replace(r.spec, env=env), count)

    def _restart_all(self, failed: TaskProcess, how: str) -> None:
        """Stop every task of the group (all of them, or the chief and workers: "replicas") and start them again
        (each resumes from the newest checkpoint; ps tasks left running keep their state)."""
        count = failed.restarts + 1
        group = [r for r in self._running if self.restart_scope != "replicas" or r.spec.job != "ps"]
        what = "tasks" if len(group) == len(self._running) else "chief and worker tasks (the ps tasks go on)"
        self._say(f"{failed.spec.name} (pid {failed.proc.pid}) {how}; restarting all {len(group)} {what} "
                  f"({count} of {self.max_restarts}): all-reduce replicas cannot go on without it"
                  f"{_verdict.restart_note(failed.report_path)}")
        self.stop_all(group)
        started = {id(r): self._restart(r, count) for r in group}
        self._running = [started.get(id(r), r) for r in self._running]
        self._say("started " + ", ".join(f"{r.spec.name} (pid {r.proc.pid})" for r in started.values()))

    def stop_all(self, only: Optional[Sequence[TaskProcess]] = None) -> None:
        """SIGTERM every task's process group (or `only` those tasks'), SIGKILL what is left after STOP_GRACE_S;
        waits for them."""
        stopping = list(self._running if only is None else only)
        alive = [r for r in stopping if r.proc.poll() is None]
        for r in alive:
            r.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for r in alive:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for r in stopping:
            r.signal_group(signal.SIGKILL)  # also reaps anything the task left in its group
            if r.proc.poll() is None:
                r.proc.kill()
            try:
                r.proc.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
            r.finish_output(0.5)


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc; False where there is none)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(caught >> (signum - 1) & 1)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
