"""A task's per-step numbers, summed cheaply and flushed as one metrics record every few steps.

Plotting a run needs many points; writing a line per step of a fast run would fill the disk.
`FlushRule` says when the window is due: every `min_steps` steps at first, then every
`local_step / points` steps (the spacing grows with the run, so a run of any length gives about
`points` records per decade of steps: ≥ 100 for a 200-step run, ~2,000 for a million), and
after `max_secs` whatever the count (slow steps still make a point). `StepAccumulator` adds a
step in a few nanoseconds (a float add) and turns a due window into the record's fields.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Dict, Optional


@dataclasses.dataclass(frozen=True)
class FlushRule:
    """When a window of steps becomes a record."""

    min_steps: int = 2
    points: int = 200
    max_secs: float = 10.0

    def __post_init__(self):
        if self.min_steps < 1 or self.points < 1 or not self.max_secs > 0:
            raise ValueError(f"{self!r}: expected min_steps >= 1, points >= 1 and max_secs > 0 "
                             "(e.g. FlushRule(min_steps=2, points=200, max_secs=10))")

    def every(self, local_step: int) -> int:
        """The window length (in steps) at this task's `local_step`."""
        return max(self.min_steps, local_step // self.points)

    def is_due(self, steps: int, secs: float, local_step: int) -> bool:
        return steps > 0 and (steps >= self.every(local_step) or secs >= self.max_secs)


class StepAccumulator:
    """Sums of one window (loss, steps, samples); `flush()` returns the record's fields and starts the next."""

    def __init__(self, rule: FlushRule = FlushRule(), clock: Callable[[], float] = time.perf_counter):
        self.rule = rule
        self.clock = clock
        self._start = clock()
        self._steps = 0
        self._loss_sum = 0.0
        self._losses = 0
        self._samples = 0

    def add(self, loss: Optional[float] = None, samples: int = 0) -> None:
        self._steps += 1
        self._samples += samples
        if loss is not None and math.isfinite(loss):
            self._loss_sum += loss
            self._losses += 1

    def is_due(self, local_step: int) -> bool:
        return self.rule.is_due(self._steps, self.clock() - self._start, local_step)

    @property
    def pending(self) -> int:
        """Steps added since the last flush."""
        return self._steps

    def flush(self) -> Dict[str, Any]:
        """`loss` (the window's mean), `steps_per_sec` and, when given, `samples_per_sec`."""
        now = self.clock()
        secs = now - self._start
        out: Dict[str, Any] = {}
        if self._losses:
            out["loss"] = self._loss_sum / self._losses
        if secs > 0 and self._steps:
            out["steps_per_sec"] = round(self._steps / secs, 3)
            if self._samples:
                out["samples_per_sec"] = round(self._samples / secs, 1)
        self._start, self._steps, self._loss_sum, self._losses, self._samples = now, 0, 0.0, 0, 0
        return out
