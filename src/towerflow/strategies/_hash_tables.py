"""`HashEmbedding` tables in one process: the ps's row stores held and trained here.

The same script runs with parameter servers (the rows on the ps tasks) and without. In one process
`setup` gives each HashEmbedding a `HashRows` of its own (ps/tables/vocabulary.py, the ps's own store),
looked up through the same two-pass `TableLookups` a ps worker uses, and trained after each
optimizer step by the row-wise optimizer (`sparse_optimizer=`, else the row-wise form of the
model's optimizer). Admission, eviction and forgetting count this process's optimizer steps, as
the ps counts global steps. Replicas that all-reduce would each grow a vocabulary of their own,
so they are refused, naming the launch that shares one.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from towerflow.errors import StrategyError
from towerflow.ps.tables.row_optimizers import RowOptimizer, SparseSGD, row_optimizer_for
from towerflow.ps.tables.vocabulary import HashRows
from towerflow.ps.worker.lookups import TableLookups, find_tables


def hash_tables(model: nn.Module) -> Dict[str, nn.Module]:
    return {name: m for name, m in find_tables(model, None).items() if getattr(m, "is_hash_table", False)}


def check_one_process(strategy, tables: Dict[str, nn.Module]) -> None:
    """Refuse what would silently train the wrong thing: replicas with vocabularies of their own, fp16 scaling."""
    names = sorted(tables)
    if strategy.num_replicas_in_sync > 1:
        raise StrategyError(
            f"HashEmbedding {names} under {type(strategy).__name__} with {strategy.num_replicas_in_sync} replicas: each "
            "replica would grow a vocabulary of its own. Keep hash tables on parameter servers "
            "(`towerflow launch --ps 1 --workers N script.py`, ParameterServerStrategy; add `--dense allreduce` to keep "
            "the rest of the model all-reduced) or train in one process"
        )
    if strategy.autocast_dtype == torch.float16:
        raise StrategyError(
            f"HashEmbedding {names} with mixed_precision='fp16': the loss scaler does not reach the tables' rows; use "
            "mixed_precision='bf16' (no scaling) or none"
        )
    if strategy.variables_on == "cpu":
        raise StrategyError(f"HashEmbedding {names} with variables_on='cpu' is not supported: keep variables_on='device'")


class LocalHashTables:
    """The hash tables of a model in this process, with an optimizer's face: `step()` trains their rows."""

    def __init__(self, model: nn.Module, tables: Dict[str, nn.Module], row_optimizer: RowOptimizer,
                 device: torch.device):
        self.stores = {
            name: HashRows(m.embedding_dim, row_optimizer, dtype=m.dtype, init_std=m.init_std, seed=i,
                           admit_after=m.admit_after, evict_after=m.evict_after, forget_after=m.forget_after)
            for i, (name, m) in enumerate(sorted(tables.items()))
        }
        self.device = device
        self.steps = 0  # optimizer steps taken: the tables' clock
        self.lookups = TableLookups(model, tables, self._read, device)
        self.param_groups: List[dict] = []  # the rows are not parameters: lr schedules and clipping pass them by
        self.state: dict = {}  # what TableOptimizers.state merges: the rows' state is in the stores

    def _read(self, unique: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        return {name: self.stores[name].read(ids.cpu(), self.steps).to(self.device) for name, ids in unique.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: every forward looks up fresh leaf rows."""

    def step(self, closure=None) -> None:
        """Apply the last training forward's row gradients, then evict; stamped with the step count after this
        update, as the ps stamps an update with the global step that counts it (reads use the count before)."""
        self.steps += 1
        for name, (ids, grads) in self.lookups.take_row_grads().items():
            self.stores[name].apply(ids.cpu(), grads.detach().cpu(), self.steps)
        for store in self.stores.values():
            store.evict(self.steps)

    def metrics(self) -> Dict[str, Dict[str, int]]:
        """{table: rows, admitted, evicted, pending}, as a ps task reports its tables'."""
        return {name: store.metrics() for name, store in self.stores.items()}

    def state_dict(self) -> dict:
        return {"steps": self.steps, "tables": {name: store.state_dict() for name, store in self.stores.items()}}

    def load_state_dict(self, state: dict) -> None:
        missing = sorted(set(self.stores) - set(state.get("tables", {})))
        if missing:
            raise StrategyError(f"the checkpoint has no rows for the hash tables {missing}: it was written by another model")
        self.steps = int(state["steps"])
        for name, store in self.stores.items():
            store.load_state_dict(state["tables"][name])


def local_hash_tables(strategy, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                      sparse_optimizer: Optional[RowOptimizer]) -> Optional[LocalHashTables]:
    """This process's hash tables for `model`, or None when it has none."""
    tables = hash_tables(model)
    if not tables:
        return None
    check_one_process(strategy, tables)
    if sparse_optimizer is not None:
        rows = sparse_optimizer
    elif optimizer is not None:
        rows = row_optimizer_for(optimizer)
    else:
        rows = SparseSGD(lr=0.0)  # no optimizer: the tables are only read
    return LocalHashTables(model, tables, rows, strategy.device)
