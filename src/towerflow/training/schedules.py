"""Learning rates keyed on the global step (TF's `tf.train.*_decay`), as plain `step -> lr` callables.

Pass one to `strategy.setup(..., lr_schedule=...)`; it is evaluated before every update with
the global step, which all replicas share, so every replica uses the same rate.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from towerflow.errors import ConfigError

Schedule = Callable[[int], float]


def exponential_decay(learning_rate: float, decay_steps: int, decay_rate: float, staircase: bool = False) -> Schedule:
    """`lr * decay_rate ** (step / decay_steps)`; with `staircase` the exponent is floored (TF's `exponential_decay`)."""
    if decay_steps <= 0:
        raise ConfigError(f"decay_steps={decay_steps!r}: expected a positive number of steps")

    def schedule(step: int) -> float:
        p = step / decay_steps
        return learning_rate * decay_rate ** (math.floor(p) if staircase else p)

    return schedule


def piecewise_constant(boundaries: Sequence[int], values: Sequence[float]) -> Schedule:
    """`values[i]` while `step <= boundaries[i]`, then the next value (TF's `piecewise_constant`)."""
    if len(values) != len(boundaries) + 1 or list(boundaries) != sorted(boundaries):
        raise ConfigError(
            f"boundaries={list(boundaries)!r}, values={list(values)!r}: expected increasing boundaries and "
            "one more value than boundaries"
        )

    def schedule(step: int) -> float:
        for b, v in zip(boundaries, values):
            if step <= b:
                return v
        return values[-1]

    return schedule


def cosine_decay(learning_rate: float, decay_steps: int, alpha: float = 0.0, warmup_steps: int = 0) -> Schedule:
    """Linear warm-up for `warmup_steps`, then cosine from `learning_rate` to `alpha * learning_rate`."""
    if decay_steps <= 0 or warmup_steps < 0:
        raise ConfigError(f"decay_steps={decay_steps!r}, warmup_steps={warmup_steps!r}: expected positive / >= 0")

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return learning_rate * (step + 1) / warmup_steps
        p = min(step - warmup_steps, decay_steps) / decay_steps
        return learning_rate * (alpha + (1 - alpha) * 0.5 * (1 + math.cos(math.pi * p)))

    return schedule
