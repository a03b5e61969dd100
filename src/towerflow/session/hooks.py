"""Session hooks: no-op base class and the built-ins of TF's MonitoredTrainingSession.

Each hook says where it runs: `runs_on = "chief"` hooks are skipped on the other tasks.
Lifecycle, in order: begin -> after_create_session -> (before_step -> after_step)* -> end.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

from towerflow.errors import TowerflowError
from towerflow.monitoring.accumulator import FlushRule, StepAccumulator

if TYPE_CHECKING:
    from towerflow.session.monitored import MonitoredTrainingSession


class NanLossError(TowerflowError, FloatingPointError):
    """Raised when the training loss became NaN or infinite (the NaN guard)."""


class SessionHook:
    """Override the methods you need; every one is a no-op here."""

    runs_on = "all"  # or "chief"

    def begin(self, session: "MonitoredTrainingSession") -> None:
        """Before the model is restored or initialized."""

    def after_create_session(self, session: "MonitoredTrainingSession") -> None:
        """After restore/initialization, before the first step."""

    def before_step(self, session: "MonitoredTrainingSession") -> None:
        """Before each `session.run(...)`."""

    def after_step(self, session: "MonitoredTrainingSession", loss: Optional[float]) -> None:
        """After each step; `session.global_step` is already the new step."""

    def end(self, session: "MonitoredTrainingSession") -> None:
        """When the session closes normally (not on an exception)."""


class StopAtStepHook(SessionHook):
    """Stop once the global step reaches `last_step` (or `num_steps` past where this run started)."""

    def __init__(self, num_steps: Optional[int] = None, last_step: Optional[int] = None):
        if (num_steps is None) == (last_step is None):
            raise ValueError(f"StopAtStepHook(num_steps={num_steps!r}, last_step={last_step!r}): give exactly one")
        self.num_steps, self.last_step = num_steps, last_step

    def after_create_session(self, session) -> None:
        if self.num_steps is not None:
            self.last_step = session.global_step + self.num_steps
        if session.global_step >= self.last_step:
            session.request_stop()

    def after_step(self, session, loss) -> None:
        if session.global_step >= self.last_step:
            session.request_stop()


class NanGuardHook(SessionHook):
    """Fail fast (or stop) when the loss stops being a finite number."""

    def __init__(self, fail_on_nan: bool = True):
        self.fail_on_nan = fail_on_nan

    def after_step(self, session, loss) -> None:
        if loss is not None and not math.isfinite(loss):
            if self.fail_on_nan:
                raise NanLossError(
                    f"the loss is {loss} at step {session.global_step}; lower the learning rate, clip gradients, "
                    "or check the input data. The newest checkpoint is before this step."
                )
            session.request_stop()


class MetricsHook(SessionHook):
    """Every task: the steps' losses summed cheaply, one metrics record per window (`FlushRule`:
    every 2 steps at first, spacing growing with the run, at least every 10 s) with the window's
    mean loss, steps/s and the strategy's counters (staleness, bytes moved); the last window at the end."""

    def __init__(self, rule: FlushRule = FlushRule()):
        self.rule = rule
        self.window: Optional[StepAccumulator] = None

    def after_create_session(self, session) -> None:
        self.window = StepAccumulator(self.rule)

    def after_step(self, session, loss) -> None:
        self.window.add(loss)
        if self.window.is_due(session.local_steps):
            self._write(session)

    def end(self, session) -> None:
        if self.window is not None and self.window.pending:
            self._write(session)

    def _write(self, session) -> None:
        fields = self.window.flush()
        session.last_steps_per_sec = fields.get("steps_per_sec", session.last_steps_per_sec)
        if session.metrics is not None:
            session.metrics.write(session.global_step, local_step=session.local_steps, **fields, **session.extra_metrics())


class LoggingHook(SessionHook):
    """Every `every_n_steps`: a line with step, loss and steps/s (on the chief, or on every task with
    `all_tasks=True` — the launcher prefixes each task's lines). The metrics records are MetricsHook's."""

    def __init__(self, every_n_steps: int = 100, stream=None, all_tasks: bool = False):
        self.every_n_steps = max(1, every_n_steps)
        self.stream = stream
        self.all_tasks = all_tasks
        self._last_time: Optional[float] = None
        self._last_step = 0
        self._last_loss: Optional[float] = None

    def after_create_session(self, session) -> None:
        self._last_time, self._last_step = time.perf_counter(), session.local_steps

    def after_step(self, session, loss) -> None:
        # Counted in this task's own steps: with parameter servers the global step also moves
        # with the other workers' pushes.
        self._last_loss = loss
        if session.local_steps - self._last_step >= self.every_n_steps:
            self._report(session, loss)

    def end(self, session) -> None:
        if session.local_steps > self._last_step:  # the last stretch, so every task reports at least once
            self._report(session, self._last_loss)

    def _report(self, session, loss) -> None:
        local = session.local_steps
        now = time.perf_counter()
        rate = (local - self._last_step) / (now - self._last_time) if now > self._last_time else 0.0
        self._last_time, self._last_step = now, local
        step = session.global_step
        session.last_steps_per_sec = rate
        if session.is_chief or self.all_tasks:
            loss_text = f"{loss:.4f}" if loss is not None else "-"
            print(f"step {step}  loss {loss_text}  {rate:.1f} steps/s", file=self.stream or sys.stdout, flush=True)


class CheckpointHook(SessionHook):
    """Save every `every_n_steps` or `every_n_secs` (and at the end), on the chief."""

    runs_on = "chief"

    def __init__(self, every_n_steps: Optional[int] = None, every_n_secs: Optional[float] = None):
        if every_n_steps is None and every_n_secs is None:
            raise ValueError("CheckpointHook needs every_n_steps or every_n_secs")
        self.every_n_steps, self.every_n_secs = every_n_steps, every_n_secs
        self._last_step = 0
        self._last_time = 0.0

    def after_create_session(self, session) -> None:
        # As TF's CheckpointSaverHook: a checkpoint of the starting state, so that there is always
        # one to go back to (a lost ps is restored from it).
        newest = session.checkpoints.latest() if session.checkpoints is not None else None
        if newest is None or newest.step != session.global_step:
            session.save_checkpoint()
        self._last_step, self._last_time = session.global_step, time.monotonic()

    def after_step(self, session, loss) -> None:
        due_steps = self.every_n_steps is not None and session.global_step - self._last_step >= self.every_n_steps
        due_secs = self.every_n_secs is not None and time.monotonic() - self._last_time >= self.every_n_secs
        if due_steps or due_secs:
            self._save(session)

    def end(self, session) -> None:
        if session.global_step != self._last_step:
            self._save(session)

    def _save(self, session) -> None:
        session.save_checkpoint()
        self._last_step, self._last_time = session.global_step, time.monotonic()


class SummaryHook(SessionHook):
    """Loss and steps/s to TensorBoard every `every_n_steps`, when tensorboard is installed (chief).

    MonitoredTrainingSession no longer adds it: with a logdir every task's metrics records go to
    TensorBoard as well (monitoring/tensorboard.py). Kept for scripts that add it themselves."""

    runs_on = "chief"

    def __init__(self, logdir: str, every_n_steps: int = 100):
        self.logdir, self.every_n_steps = logdir, max(1, every_n_steps)
        self.writer: Any = None

    def begin(self, session) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return  # optional: pip install 'towerflow[tensorboard]'
        self.writer = SummaryWriter(self.logdir)

    def after_step(self, session, loss) -> None:
        if self.writer is not None and session.global_step % self.every_n_steps == 0:
            if loss is not None:
                self.writer.add_scalar("loss", loss, session.global_step)
            if session.last_steps_per_sec:
                self.writer.add_scalar("steps_per_sec", session.last_steps_per_sec, session.global_step)

    def end(self, session) -> None:
        if self.writer is not None:
            self.writer.close()


class ProgressHook(SessionHook):
    """A tqdm bar on an interactive terminal (the chief's); LoggingHook's lines cover the rest."""

    runs_on = "chief"

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.bar: Any = None

    def after_create_session(self, session) -> None:
        if not (hasattr(self.stream, "isatty") and self.stream.isatty()):
            return
        from tqdm.auto import tqdm

        stop = next((h for h in session.hooks if isinstance(h, StopAtStepHook)), None)
        if stop is None:
            last = None
        else:  # StopAtStepHook may not have turned num_steps into a last step yet
            last = stop.last_step if stop.last_step is not None else session.global_step + stop.num_steps
        self.bar = tqdm(total=last, initial=session.global_step, file=self.stream, dynamic_ncols=True, desc="train")

    def after_step(self, session, loss) -> None:
        if self.bar is not None:
            self.bar.update(session.global_step - self.bar.n)
            if loss is not None and session.global_step % 10 == 0:
                self.bar.set_postfix(loss=f"{loss:.4f}")

    def end(self, session) -> None:
        if self.bar is not None:
            self.bar.close()
