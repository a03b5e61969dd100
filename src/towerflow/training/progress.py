"""Progress of a training loop: a tqdm bar on an interactive terminal, plain lines otherwise.

Only the chief shows anything. Throughput is reported per replica and in total
(samples/s over the global batch), measured from the second step so start-up does not count.
With a log folder (`logdir=`, else the launch's `--logdir`) every task also appends its loss
curve to LOGDIR/metrics.jsonl, as MonitoredTrainingSession does: scripts with a plain loop
show up in `towerflow top` and `towerflow report` too.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Optional

from towerflow.data.batch_facts import batch_facts
from towerflow.monitoring.accumulator import StepAccumulator
from towerflow.monitoring.metrics import EVENT_END, EVENT_START, MetricsWriter


class Progress:
    """Call `update(loss)` once per step, with the loss `train_step` returned or `batch=` the step's batch:
    samples are counted from the batch's facts (steps alone when neither carries them)."""

    def __init__(self, strategy, total_steps: int, log_every: int = 50, desc: str = "train",
                 stream: Optional[IO[str]] = None, bar: Optional[bool] = None, logdir: Optional[str] = None):
        self.strategy = strategy
        self.total_steps = total_steps
        self.log_every = max(1, log_every)
        self.stream = stream or sys.stderr
        self.enabled = strategy.is_chief
        is_tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = None
        if self.enabled and (is_tty if bar is None else bar):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, desc=desc, file=self.stream, dynamic_ncols=True)
        self.desc = desc
        self.steps = 0
        self.local_samples = self.global_samples = 0
        self._t0: Optional[float] = None
        here = strategy.context
        logdir = logdir or here.tuning.logdir
        self.metrics: Optional[MetricsWriter] = None
        self._window: Optional[StepAccumulator] = None
        if logdir:
            self.metrics = MetricsWriter(logdir, f"{here.identity.job_name or 'localhost'}:{here.identity.task_index or 0}",
                                         role="chief" if strategy.is_chief else "worker",
                                         device=getattr(strategy, "device_name", None))
            self.metrics.write(strategy.global_step, event=EVENT_START, restarts=here.identity.restart_count)
            self._window = StepAccumulator()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0 if self._t0 is not None else 0.0

    @property
    def samples_per_sec(self) -> float:
        """All replicas together."""
        return self.global_samples / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def samples_per_sec_per_replica(self) -> float:
        return self.local_samples / self.elapsed if self.elapsed > 0 else 0.0

    def update(self, loss=None, batch=None) -> None:
        self.steps += 1
        facts = batch_facts(batch if batch is not None else loss)
        if self._t0 is None:
            self._t0 = time.perf_counter()  # step 1 is warm-up: the clock starts after it
        elif facts is not None:
            self.local_samples += facts.local_size
            self.global_samples += facts.global_size
        if self._window is not None:
            self._window.add(float(loss) if loss is not None else None)
            if self._window.is_due(self.steps):
                self._write_window()
        if not self.enabled:
            return
        loss_text = f"{float(loss):.4f}" if loss is not None else "-"
        if self._bar is not None:
            self._bar.update(1)
            if self.steps % 10 == 0 or self.steps == self.total_steps:
                self._bar.set_postfix_str(f"loss {loss_text} | {self._rate_text(short=True)}")
        elif self.steps % self.log_every == 0 or self.steps == self.total_steps:
            print(f"{self.desc} step {self.strategy.global_step}/{self.total_steps}  loss {loss_text}  "
                  f"{self._rate_text(short=False)}", file=self.stream, flush=True)

    def _rate_text(self, short: bool) -> str:
        if not self.global_samples:  # no batch facts seen: the loop's own batches, or plain numbers
            steps_per_sec = (self.steps - 1) / self.elapsed if self.elapsed > 0 else 0.0
            return f"{steps_per_sec:.1f} steps/s"
        if short:
            return f"{self.samples_per_sec:.0f} samples/s ({self.samples_per_sec_per_replica:.0f}/replica)"
        return f"{self.samples_per_sec:.0f} samples/s total  {self.samples_per_sec_per_replica:.0f} samples/s/replica"

    def _write_window(self) -> None:
        self.metrics.write(self.strategy.global_step, local_step=self.steps, **self._window.flush())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.metrics is not None:
            if self._window.pending:
                self._write_window()
            self.metrics.write(self.strategy.global_step, event=EVENT_END)
            self.metrics.close()
            self.metrics = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
