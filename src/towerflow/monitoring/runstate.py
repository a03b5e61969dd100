"""A run's state and each task's, from the events in `metrics.jsonl`.

Tasks record `start` (with `restarts`, how often the launcher restarted them), `end` or
`failed` (with `error`); the launcher records each task process's `exit` (`exit_task`,
`exit_code`, `stopped` when it stopped the task itself) and the run's `run start` / `run end`
under the task name `launcher` (launch/runlog.py). From these: a task is running,
finished or failed, restarted n times; the run is running, finished or failed. A file from a
job that recorded no events (older towerflow, or a script's own MetricsWriter) reads as running
while records arrive and as `silent` after `silent_after` seconds without one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional

from towerflow.monitoring.metrics import (
    EVENT_END,
    EVENT_EXIT,
    EVENT_FAILED,
    EVENT_RUN_END,
    EVENT_RUN_START,
    EVENT_START,
)

LAUNCHER = "launcher"  # the task name of the launcher's records
RUNNING, FINISHED, FAILED, SILENT, STOPPED = "running", "finished", "failed", "silent", "stopped"
SILENT_AFTER_S = 120.0


@dataclasses.dataclass
class TaskState:
    task: str
    state: str = RUNNING
    restarts: int = 0
    error: Optional[str] = None
    first_time: float = 0.0
    last_time: float = 0.0

    def describe(self) -> str:
        """`running`, `finished`, `failed`, with `, restarted 2x` when it was."""
        return self.state + (f", restarted {self.restarts}x" if self.restarts else "")


@dataclasses.dataclass
class RunState:
    state: str
    tasks: Dict[str, TaskState]
    started: float
    last_record: float
    exit_code: Optional[int] = None

    @property
    def wall_s(self) -> float:
        return max(0.0, self.last_record - self.started)

    @property
    def is_over(self) -> bool:
        return self.state in (FINISHED, FAILED)

    @property
    def failures(self) -> int:
        return sum(t.state == FAILED for t in self.tasks.values())

    @property
    def restarts(self) -> int:
        return sum(t.restarts for t in self.tasks.values())

    def describe(self, now: Optional[float] = None) -> str:
        """One line: `finished in 12.3 s`, `failed (exit code 1) after 4.0 s`, `running for 30 s`."""
        counts = f"{len(self.tasks)} tasks"
        if self.restarts:
            counts += f", {self.restarts} restarts"
        if self.state == FINISHED:
            return f"finished in {self.wall_s:.1f} s ({counts})"
        if self.state == FAILED:
            code = f" (exit code {self.exit_code})" if self.exit_code else ""
            return f"FAILED{code} after {self.wall_s:.1f} s ({counts}, {self.failures} failed)"
        age = (time.time() if now is None else now) - self.last_record
        if self.state == SILENT:
            return f"silent: no record for {age:.0f} s ({counts}); ended without saying so, or stuck?"
        return f"running for {self.wall_s:.0f} s ({counts}), last record {age:.0f} s ago"


def _apply(t: TaskState, record: Dict[str, Any]) -> None:
    event = record.get("event")
    if event == EVENT_START:
        t.restarts = max(t.restarts, int(record.get("restarts", 0)))
        t.state, t.error = RUNNING, None
    elif event == EVENT_END:
        t.state = FINISHED
    elif event == EVENT_FAILED:
        t.state, t.error = FAILED, record.get("error")
    elif event == EVENT_EXIT:
        code = record.get("exit_code")
        t.restarts = max(t.restarts, int(record.get("restarts", 0)))
        if record.get("stopped"):
            t.state = STOPPED if t.state == RUNNING else t.state
        elif code == 0:
            t.state = FINISHED if t.state != FAILED else t.state
        else:
            t.state = FAILED
            t.error = t.error or (f"killed by signal {-code}" if isinstance(code, int) and code < 0 else f"exit code {code}")


def run_state(records: List[Dict[str, Any]], now: Optional[float] = None,
              silent_after: float = SILENT_AFTER_S) -> RunState:
    """The run's state and every task's (the launcher's own records excluded), from records in file order."""
    if not records:
        raise ValueError("run_state: no records; expected the records of metrics.jsonl (read_metrics(LOGDIR))")
    now = time.time() if now is None else now
    tasks: Dict[str, TaskState] = {}
    run_end: Optional[Dict[str, Any]] = None
    started = min(r["time"] for r in records)
    for r in records:
        name = r["task"]
        if name == LAUNCHER or r.get("role") == LAUNCHER:
            if r.get("event") == EVENT_RUN_END:
                run_end = r
            elif r.get("event") == EVENT_RUN_START:
                run_end = None  # a launch in the same logdir again
            if r.get("event") != EVENT_EXIT or not r.get("exit_task"):
                continue
            name = r["exit_task"]  # the launcher saw this task's process exit
        t = tasks.get(name)
        if t is None:
            t = tasks[name] = TaskState(name, first_time=r["time"])
        t.last_time = max(t.last_time, r["time"])
        _apply(t, r)
    last = max(r["time"] for r in records)
    if run_end is not None:
        code = int(run_end.get("exit_code", 0))
        for t in tasks.values():  # the launcher stopped what still ran
            if t.state == RUNNING:
                t.state = FINISHED if code == 0 else STOPPED
        return RunState(FINISHED if code == 0 else FAILED, tasks, started, last, code)
    states = {t.state for t in tasks.values()}
    if tasks and states == {FINISHED}:
        return RunState(FINISHED, tasks, started, last, 0)
    if FAILED in states and RUNNING not in states:
        return RunState(FAILED, tasks, started, last)
    if now - last > silent_after:
        for t in tasks.values():
            if t.state == RUNNING:
                t.state = SILENT
        return RunState(SILENT, tasks, started, last)
    return RunState(RUNNING, tasks, started, last)
