"""The optimizer a hybrid worker trains with: the dense step here, after the all-reduce, then the row push.

`SyncOptimizer` does the dense part as every all-reduce strategy does (lr schedule, clipping of the
all-reduced gradient, the global step); what it adds is the embedding tables' row gradients, pushed to
the ps tasks after the dense update, and a `state_dict` that holds both sides: the dense optimizer's
state here and the ps tasks' tables with their row-optimizer state under "ps", where a ps strategy keeps
them (so a lost ps task is restored from a hybrid checkpoint the same way).
"""

from __future__ import annotations

from towerflow.strategies._optimizer import SyncOptimizer


class HybridOptimizer(SyncOptimizer):
    """What `ParameterServerStrategy(dense="allreduce").setup` returns in place of the user's optimizer."""

    def step(self, closure=None) -> None:
        """The all-reduced dense gradient applied here, then this worker's row gradients pushed to the ps tasks."""
        super().step(closure)
        self.strategy._push_rows()

    def state_dict(self) -> dict:
        """The dense optimizer's state and the global step (as all-reduce keeps them) and the ps tasks' tables."""
        out = super().state_dict()
        out["ps"] = self.strategy._ps_state()
        return out

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's dense optimizer state here, its tables onto the ps tasks (`_load_ps_state` says when)."""
        super().load_state_dict(state)
        self.strategy._load_ps_state(state.get("ps") or {})

    def __repr__(self) -> str:
        return (f"HybridOptimizer({type(self.optimizer).__name__} on this worker after the all-reduce, tables on the "
                f"ps, global_step={self.strategy.global_step})")
