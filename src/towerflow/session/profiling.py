"""A window of training steps under `torch.profiler`, as TF's ProfilerHook: a trace to open and a table to read.

Where a step's time goes differs by task (a ps worker waits on the wire, an all-reduce replica in its
collective, a GPU worker in copies), so every task that runs the hook profiles its own steps and writes
its own files under the output directory: `TASK-steps-A-B.trace.json` (Chrome trace format: chrome://tracing
or https://ui.perfetto.dev) and `TASK-steps-A-B.txt` (the ops by their own time, on the GPU first when there
is one). The window starts at the first step at or past global step `start`, since with parameter servers the
global step moves with every worker's pushes and a task may never see one exact value.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

from towerflow import _log
from towerflow._io import atomic_write
from towerflow.session.hooks import SessionHook


class ProfilerHook(SessionHook):
    """Profile `steps` of this task's steps from global step `start` on; files under `output_dir`, else the
    session's `LOGDIR/profile`."""

    def __init__(self, start: int, steps: int = 5, output_dir: Optional[str] = None, row_limit: int = 30):
        if not isinstance(start, int) or start < 0 or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"ProfilerHook(start={start!r}, steps={steps!r}): expected a global step start >= 0 and "
                             "steps >= 1 (how many of this task's steps to profile), e.g. ProfilerHook(100, 5)")
        self.start, self.steps, self.output_dir, self.row_limit = start, steps, output_dir, row_limit
        self._profiler: Any = None
        self._first: Optional[int] = None  # the global step the window began at
        self._cuda = False  # the window records the GPU's kernels too
        self._taken = 0
        self.written: Optional[str] = None  # the trace's path, once written

    def begin(self, session) -> None:
        if self.output_dir is None:
            if not session.logdir:
                raise ValueError(f"ProfilerHook(start={self.start}) has nowhere to write: give it output_dir= or give "
                                 "the MonitoredTrainingSession a logdir (the files then go to LOGDIR/profile)")
            self.output_dir = os.path.join(session.logdir, "profile")

    def before_step(self, session) -> None:
        if self._profiler is None and self.written is None and session.global_step >= self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            self._cuda = torch.cuda.is_available()
            if self._cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._first = session.global_step
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()

    def after_step(self, session, loss) -> None:
        if self._profiler is None:
            return
        self._taken += 1
        if self._taken >= self.steps:
            self._finish(session)

    def end(self, session) -> None:
        if self._profiler is not None:  # the run ended inside the window: what was profiled still counts
            self._finish(session)

    def _finish(self, session) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        task = session.task.replace(":", "")
        base = os.path.join(self.output_dir, f"{task}-steps-{self._first}-{session.global_step}")
        os.makedirs(self.output_dir, exist_ok=True)
        trace, partial = f"{base}.trace.json", f"{base}.trace.json.{os.getpid()}.tmp"
        try:
            profiler.export_chrome_trace(partial)
            os.replace(partial, trace)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(partial)
        table = profiler.key_averages().table(
            sort_by="self_device_time_total" if self._cuda else "self_cpu_time_total", row_limit=self.row_limit)
        with atomic_write(f"{base}.txt", "w") as f:
            f.write(f"{session.task}: {self._taken} steps from global step {self._first} to {session.global_step}\n")
            f.write(table)
        self.written = trace
        _log.get("session", session.task).info(
            f"profiled {self._taken} steps (global steps {self._first} to {session.global_step}): {trace} "
            f"(chrome://tracing or ui.perfetto.dev), the ops by time in {base}.txt")
