"""Embedding tables trained in this process: the user's optimizer for the dense part, and the torch
optimizer matching `sparse_optimizer=` for the tables, stepped as one.

The same script passes `sparse_optimizer=towerflow.ps.SparseAdam(lr=...)` to every strategy: with
parameter servers the row-wise optimizer runs on the ps tasks; here (one process, or all-reduce
replicas) its torch twin (`torch.optim.SparseAdam`, ...) trains the tables' sparse gradients.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from towerflow.errors import StrategyError
from towerflow.ps.tables.row_optimizers import RowOptimizer, torch_optimizer_for
from towerflow.ps.worker.lookups import find_tables


class TableOptimizers:
    """Several torch optimizers with one optimizer's face (what `SyncOptimizer` wraps)."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers
        self.defaults = optimizers[0].defaults

    @property
    def param_groups(self) -> List[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None) -> None:
        for opt in self.optimizers:
            opt.step()

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        for opt, part in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(part)


def with_table_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         sparse_optimizer: Optional[RowOptimizer], hash_tables=None):
    """The user's optimizer (dense parameters only), the tables' torch optimizer and this process's hash
    tables (`_hash_tables.LocalHashTables`), as one; the user's optimizer alone when there are no tables."""
    extra = [hash_tables] if hash_tables is not None else []
    if sparse_optimizer is None:
        return TableOptimizers(optimizer, *extra) if extra else optimizer
    tables = [m.weight for m in find_tables(model, None).values() if isinstance(getattr(m, "weight", None),
                                                                                torch.nn.Parameter)]
    if not tables:
        if not extra:
            raise StrategyError("sparse_optimizer= was given but the model has no table with sparse=True; drop it, or "
                                "build the tables as nn.Embedding / nn.EmbeddingBag(..., sparse=True) or HashEmbedding")
        return TableOptimizers(optimizer, *extra)
    ids = {id(p) for p in tables}
    shared = [p for g in optimizer.param_groups for p in g["params"] if id(p) in ids]
    if shared:
        raise StrategyError("with sparse_optimizer=, build the optimizer over the dense parameters only (the tables "
                            "get sparse_optimizer's): e.g. Adam(p for n, p in model.named_parameters() if not a table)")
    return TableOptimizers(optimizer, torch_optimizer_for(sparse_optimizer, tables), *extra)
