"""What a worker counts of its calls to the ps tasks: bytes each way, what became of its pushes, waiting time.

Kept apart from the calls themselves so that `metrics()` reads one small object, and the step code
only says what happened (`pushed`, `pulled`, `replied`, `waited`).
"""

from __future__ import annotations

import collections
import time
from typing import Dict, Optional


class StepCounters:
    """Bytes pushed and pulled per ps task, push outcomes, the staleness of applied pushes, pull waits."""

    def __init__(self) -> None:
        self.bytes_pushed: Dict[int, int] = collections.Counter()
        self.bytes_pulled: Dict[int, int] = collections.Counter()
        self.staleness: Dict[int, int] = collections.Counter()
        self.outcomes: Dict[str, int] = collections.Counter()
        self.started: Optional[float] = None  # when training began (the first values installed)
        self.pull_wait_s = 0.0

    def start(self) -> None:
        self.started = time.perf_counter()

    def pushed(self, task: int, nbytes: int) -> None:
        self.bytes_pushed[task] += nbytes

    def pulled(self, task: int, nbytes: int) -> None:
        self.bytes_pulled[task] += nbytes

    def replied(self, outcome) -> None:
        """A push's outcome as the ps tells it: applied, held or dropped, and how stale it was."""
        self.outcomes[outcome.kind] += 1
        if outcome.kind != "dropped":
            self.staleness[outcome.staleness] += 1

    def waited(self, seconds: float) -> None:
        self.pull_wait_s += seconds

    def metrics(self, worker: int, pushes: int, global_step: int, links: Dict[str, str]) -> dict:
        """This worker's view: steps/s, bytes per ps task, what became of its pushes, how it reaches each ps task."""
        elapsed = time.perf_counter() - self.started if self.started else 0.0
        ps = lambda counts: {f"/job:ps/task:{t}": n for t, n in sorted(counts.items())}  # noqa: E731
        return {
            "worker": worker,
            "steps": pushes,
            "global_step": global_step,
            "steps_per_s": pushes / elapsed if elapsed > 0 else 0.0,
            "bytes_pushed": ps(self.bytes_pushed),
            "bytes_pulled": ps(self.bytes_pulled),
            "pushes_applied": self.outcomes["applied"],
            "pushes_held": self.outcomes["held"],
            "pushes_dropped": self.outcomes["dropped"],
            "staleness_histogram": dict(sorted(self.staleness.items())),
            "pull_wait_s": self.pull_wait_s,
            "links": links,
        }
