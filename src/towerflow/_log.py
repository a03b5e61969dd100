"""Diagnostics: towerflow's logger hierarchy, one format, the task's name on every line.

Every area logs through `logging.getLogger("towerflow.<area>")`, most through `get(area, task)`, whose
records name the task that says them. `configure` gives the `towerflow` logger one handler, to the
stderr of the moment, in `FORMAT`: once, where a process starts (the launcher, a task's Server), or
on first use in a script that started neither. It leaves the root logger and any handler a user added
alone: records still propagate to them. A record without a task of its own is named after the task
the process was configured with, or else the one its environment names, read once on first need.
INFO is what tasks say about joins and recovery, WARNING what they went on without.

The placement log (`towerflow.placement`, TF's log_device_placement) keeps its own TF-shaped lines
and its own handler (placement/log.py); this handler leaves its records alone.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, MutableMapping, Optional, Tuple

ROOT = "towerflow"
FORMAT = "towerflow: %(task)s: %(message)s"
_OWN_FORMAT = ("towerflow.placement",)  # loggers with a user-facing format of their own


class TaskLog(logging.LoggerAdapter):
    """An area's logger whose records carry `task` (the name FORMAT shows), unless a call names another."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> Tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **(kwargs.get("extra") or {})}
        return msg, kwargs


def get(area: str, task: Optional[str] = None) -> TaskLog:
    """The `towerflow.<area>` logger, its records naming `task` (else the process's task)."""
    configure()
    return TaskLog(logging.getLogger(f"{ROOT}.{area}"), {"task": task} if task else {})


def configure(task: Optional[str] = None) -> None:
    """Give `towerflow` its handler (once) and INFO when nobody set its level; `task` names this process's
    records from now on (the launcher's "launcher", a task's '/job:worker/task:1')."""
    logger = logging.getLogger(ROOT)
    handler = next((h for h in logger.handlers if isinstance(h, _TaskHandler)), None)
    if handler is None:
        handler = _TaskHandler()
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    if task:
        handler.names.task = task


class _TaskName(logging.Filter):
    """Names a record's task when its call did not, and passes over the loggers with formats of their own."""

    def __init__(self, task: Optional[str] = None):
        super().__init__()
        self.task = task

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(_OWN_FORMAT):
            return False
        if not getattr(record, "task", None):
            if self.task is None:
                self.task = _environment_task()
            record.task = self.task
        return True


class _TaskHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when the record comes (a test's capture, a redirected stream)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)
        self.names = _TaskName()
        self.addFilter(self.names)
        self.setFormatter(logging.Formatter(FORMAT))

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _environment_task() -> str:
    """The task this process's environment names ('/job:localhost/task:0' outside a cluster)."""
    from towerflow import taskenv

    env = taskenv.current()
    return f"/job:{env.identity.job_name or 'localhost'}/task:{env.identity.task_index or 0}"
