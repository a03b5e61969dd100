"""The launcher's lines in `LOGDIR/metrics.jsonl`: the run's start and end, each task process's exit.

A task that is killed (SIGKILL, out of memory) records nothing itself; its launcher saw it go.
`towerflow top` and `towerflow report` read these records (task name `launcher`) to say whether
the run is running, finished or failed and which task failed or was restarted (monitoring/runstate.py).
Without a logdir the launcher records nothing.
"""

from __future__ import annotations

import socket
from typing import Optional, Sequence

from towerflow import taskenv
from towerflow.monitoring.metrics import EVENT_EXIT, EVENT_RUN_END, EVENT_RUN_START, MetricsWriter
from towerflow.monitoring.runstate import LAUNCHER


def task_name(job: str, index: int) -> str:
    """The name the task's own records use (`worker:1`)."""
    return f"{job}:{index}"


class RunLog:
    """Appends the launcher's records; every method is a no-op without a logdir, and never raises on a full disk."""

    def __init__(self, logdir: Optional[str]):
        self.writer: Optional[MetricsWriter] = None
        if logdir:
            try:
                self.writer = MetricsWriter(logdir, LAUNCHER, role=LAUNCHER)
            except OSError:
                self.writer = None

    @classmethod
    def for_tasks(cls, envs: Sequence[dict]) -> "RunLog":
        """The logdir the tasks were given (TOWERFLOW_LOGDIR), if any."""
        return cls(next((e[taskenv.ENV_LOGDIR] for e in envs if e.get(taskenv.ENV_LOGDIR)), None))

    def _write(self, **fields) -> None:
        if self.writer is not None:
            try:
                self.writer.write(0, **fields)
            except (OSError, ValueError):
                pass

    def run_start(self, tasks: Sequence[str]) -> None:
        self._write(event=EVENT_RUN_START, tasks=list(tasks), host=socket.gethostname())

    def task_exit(self, task: str, exit_code: Optional[int], restarts: int, stopped: bool = False) -> None:
        self._write(event=EVENT_EXIT, exit_task=task, exit_code=exit_code, restarts=restarts, stopped=stopped)

    def run_end(self, exit_code: int) -> None:
        self._write(event=EVENT_RUN_END, exit_code=exit_code)
        if self.writer is not None:
            self.writer.close()
            self.writer = None
