"""Row stores: the rows of one embedding-table shard a ps task holds, with their optimizer state.

`FixedRows` holds rows [row_start, row_stop) of a table of fixed size (TF's partitioned
variable); its ids are local row numbers. `HashRows` (`vocabulary.py`) holds a table keyed
by arbitrary int64 ids that grows as ids are seen (a Monolith-style vocabulary). Both read
rows, apply coalesced gradients to the rows a push names with a `RowOptimizer`, save and
restore themselves, and export their rows so a checkpoint written by N ps tasks can be
loaded onto M (`export` on the old shards, `load_rows` on the new ones).

Pure modules: no calls, no locks (the ps service serializes updates), so tests drive them directly.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch

from towerflow.errors import ParameterServerError
from towerflow.ps.tables.row_optimizers import RowOptimizer, State


def check_ids(ids: torch.Tensor, what: str) -> torch.Tensor:
    """`ids` as a 1-D int64 tensor, or a clear error."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
        got = f"a {ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else repr(ids)
        raise ParameterServerError(f"{what}: ids must be a 1-D int32 or int64 tensor, got {got}")
    return ids.long()


def check_rows(what: str, n: int, dim: int, dtype: torch.dtype, tensor: torch.Tensor, name: str = "grads") -> torch.Tensor:
    """A [n, dim] tensor of `dtype` (converted), or an error naming the shape that was expected."""
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != (n, dim):
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ParameterServerError(f"{what}: {name} has shape {got}, expected ({n}, {dim}): one row per id")
    return tensor.to(dtype)


def check_keys(what: str, state, keys: Iterable[str], kind: str) -> None:
    """A state_dict() of `kind` has these keys, or an error saying what it is not."""
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ParameterServerError(f"{what}: expected a {kind}.state_dict(), which has {missing}; got {got}")


def check_state(what: str, optimizer: RowOptimizer, state: Dict[str, torch.Tensor], n: int, dim: int,
                optional: Iterable[str] = ()) -> None:
    """The optimizer's state tensors, each [n, dim] (plus any of `optional`, checked by the caller)."""
    names, allowed = set(optimizer.state_names), set(optimizer.state_names) | set(optional)
    if not isinstance(state, dict) or not names <= set(state) or not set(state) <= allowed:
        got = sorted(state) if isinstance(state, dict) else repr(state)
        raise ParameterServerError(
            f"{what}: the state holds {got} but {type(optimizer).__name__} keeps {sorted(names)}: the rows were "
            "written with another sparse optimizer; load them with that one, or start the table's state afresh"
        )
    for name in names:
        check_rows(what, n, dim, state[name].dtype, state[name], f"state[{name!r}]")


class FixedRows:
    """A shard of a fixed-size table: `values` [R, D] (held, not copied) and its row-wise optimizer state."""

    def __init__(self, values: torch.Tensor, optimizer: RowOptimizer):
        if not isinstance(values, torch.Tensor) or values.dim() != 2 or not values.is_floating_point():
            got = f"{values.dtype} {tuple(values.shape)}" if isinstance(values, torch.Tensor) else repr(values)
            raise ParameterServerError(f"FixedRows(values={got}): expected a 2-D floating tensor [rows, dim]")
        if not isinstance(optimizer, RowOptimizer):
            raise ParameterServerError(
                f"FixedRows(optimizer={optimizer!r}): expected a RowOptimizer (towerflow.ps.SparseSGD, SparseAdagrad, "
                "SparseAdam or FTRL); row_optimizer_for(torch_optimizer) gives the one matching a torch optimizer"
            )
        self.values = values.detach()
        self.optimizer = optimizer
        self.state: State = optimizer.init_state(self.values)
        self.updates = 0  # applies so far: the `step` torch counts per parameter (Adam's bias correction)

    @property
    def rows_held(self) -> int:
        return self.values.shape[0]

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the values and the optimizer state."""
        return sum(t.numel() * t.element_size() for t in (self.values, *self.state.values()))

    def _ids(self, ids: torch.Tensor, what: str) -> torch.Tensor:
        ids = check_ids(ids, what)
        if ids.numel():
            lo, hi = torch.aminmax(ids)
            if lo < 0 or hi >= self.rows_held:
                bad = int(lo) if lo < 0 else int(hi)
                raise ParameterServerError(
                    f"{what}: row id {bad!r} is outside this shard's {self.rows_held} rows [0, {self.rows_held}); ids "
                    "are local to the shard (global id minus the shard's row_start)"
                )
        return ids

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """values[ids], a copy: [len(ids), D]."""
        return self.values.index_select(0, self._ids(ids, "FixedRows.read"))

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, lr: Optional[float] = None, lr_scale: float = 1.0) -> None:
        """One update of the rows `ids` (unique) with their coalesced gradients; every call counts one update."""
        ids = self._ids(ids, "FixedRows.apply")
        grads = check_rows("FixedRows.apply", ids.numel(), self.dim, self.values.dtype, grads)
        self.updates += 1
        if ids.numel():
            self.optimizer.apply(self.values, self.state, ids, grads, self.updates, lr, lr_scale)

    # ---- checkpoints and resharding
    def state_dict(self) -> dict:
        """Copies of the values, the optimizer state and the update count."""
        return {"values": self.values.clone(), "state": {k: v.clone() for k, v in self.state.items()},
                "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()` of a shard of the same shape, in place."""
        what = "FixedRows.load_state_dict"
        check_keys(what, state, ("values", "state", "updates"), "FixedRows")
        values = check_rows(what, self.rows_held, self.dim, self.values.dtype, state["values"], "values")
        check_state(what, self.optimizer, state["state"], self.rows_held, self.dim)
        self.values.copy_(values)
        for name in self.optimizer.state_names:
            self.state[name].copy_(state["state"][name])
        self.updates = int(state["updates"])

    def export(self) -> Tuple[torch.Tensor, torch.Tensor, State]:
        """Every row: (local ids int64, values, optimizer state), copies; add row_start for global ids."""
        ids = torch.arange(self.rows_held, dtype=torch.int64)
        return ids, self.values.clone(), {k: v.clone() for k, v in self.state.items()}

    def load_rows(self, ids: torch.Tensor, values: torch.Tensor, state: State, updates: Optional[int] = None) -> None:
        """Write exported rows (at local `ids`) into this shard; `updates` only ever raises the update count.

        Resharding builds each new shard from the rows of the old shards it now covers, one
        `load_rows` per old shard; taking the largest update count never rewinds Adam's bias correction.
        """
        what = "FixedRows.load_rows"
        ids = self._ids(ids, what)
        values = check_rows(what, ids.numel(), self.dim, self.values.dtype, values, "values")
        check_state(what, self.optimizer, state, ids.numel(), self.dim)
        self.values.index_copy_(0, ids, values)
        for name in self.optimizer.state_names:
            self.state[name].index_copy_(0, ids, state[name].to(self.state[name].dtype))
        if updates is not None:
            self.updates = max(self.updates, int(updates))

    def __repr__(self) -> str:
        return f"FixedRows({self.rows_held}x{self.dim}, {self.optimizer.describe()}, updates={self.updates})"
