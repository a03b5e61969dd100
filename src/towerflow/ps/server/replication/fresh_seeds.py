"""When a primary seeds its backup anew (`replicator.Replicator` asks): a rule over what was forwarded since the last seed.

A fresh seed is the primary's whole state after an op the backup holds already, so it makes every op the backup
holds before it moot: a primary whose whole state is small seeds its mirror anew now and then (`FreshSeeds` says
when), so that the backup holds the ops in between without applying them and never runs the primary's optimizer
(`mirror.py`). That pays for a small state (no tables, `REFRESH_FACTOR` times its size within half of what a mirror
holds unapplied): its backup is seeded anew once `REFRESH_FACTOR` times its state's bytes of ops were forwarded (at
least `REFRESH_BYTES`), after `REFRESH_OPS` ops however small, or once a thread's same-host ring is half full (the
backup takes a ring's records only at a seed, so one worker's ring would otherwise fill first).
"""

from __future__ import annotations

from typing import Callable

from towerflow.ps.replication_messages import MIRROR_HOLD_BYTES, REFRESH_BYTES, REFRESH_FACTOR, REFRESH_OPS


class FreshSeeds:
    """The ops forwarded since the backup's last seed, and whether the next seed is due (under the service's lock)."""

    def __init__(self) -> None:
        self.after = 0  # bytes of ops after which the backup is seeded anew (0: never)
        self.bytes = 0  # bytes of pushes forwarded since the last seed
        self.ops = 0  # ops forwarded since the last seed

    def seeded(self, state_bytes: int) -> None:
        """The backup was just seeded with a state of `state_bytes`: count afresh, by that state's size."""
        small = state_bytes and REFRESH_FACTOR * state_bytes <= MIRROR_HOLD_BYTES // 2
        self.after = max(REFRESH_FACTOR * state_bytes, REFRESH_BYTES) if small else 0
        self.bytes = self.ops = 0

    def forwarded(self, push_bytes: int = 0) -> None:
        """One more op forwarded (a push's tensors `push_bytes`)."""
        self.ops += 1
        self.bytes += push_bytes

    def due(self, ring_half_full: Callable[[], bool]) -> bool:
        """Whether to seed the backup anew now; `ring_half_full()` (this thread's ring) is asked only when the
        counts alone do not say so."""
        if not self.after:
            return False
        return self.bytes >= self.after or self.ops >= REFRESH_OPS or ring_half_full()
