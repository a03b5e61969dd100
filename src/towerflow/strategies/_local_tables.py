"""Strategies that train a model's embedding tables in this process (one device, all-reduce replicas).

The same script passes `sparse_optimizer=towerflow.ps.SparseAdam(...)` to every strategy. Here the
tables' torch twin (`_tables.py`) and a `HashEmbedding`'s rows (`_hash_tables.py`) are stepped with the
user's optimizer; parameter servers train the rows on the ps tasks instead (`parameter_server.py`).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from towerflow.ps.tables.row_optimizers import RowOptimizer
from towerflow.strategies._hash_tables import LocalHashTables, local_hash_tables
from towerflow.strategies._optimizer import SyncOptimizer
from towerflow.strategies._tables import with_table_optimizer
from towerflow.strategies.base import Strategy


class LocalTablesStrategy(Strategy):
    """A `Strategy` whose model's tables live in this process: `setup` takes `sparse_optimizer=`."""

    # the model's HashEmbedding rows, set by setup when the model has any (None: it has none)
    hash_tables: Optional[LocalHashTables] = None

    def setup(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        lr_schedule: Optional[Callable[[int], float]] = None,
        clip_grad_norm: Optional[float] = None,
        sparse_optimizer: Optional[RowOptimizer] = None,
    ) -> Tuple[torch.nn.Module, Optional[SyncOptimizer]]:
        """`Strategy.setup`, with the model's tables trained here.

        `sparse_optimizer` (`towerflow.ps.SparseAdam(...)`, ...) trains the model's sparse=True tables
        with its torch twin; `optimizer` then covers the dense parameters only. A `HashEmbedding` keeps
        its rows in this process (one replica only), trained by `sparse_optimizer` or the row-wise form
        of `optimizer`.
        """
        model = model.to(self.device)
        self.hash_tables = local_hash_tables(self, model, optimizer, sparse_optimizer)
        if optimizer is not None:
            optimizer = with_table_optimizer(model, optimizer, sparse_optimizer, self.hash_tables)
        return self._setup_placed(model, optimizer, lr_schedule, clip_grad_norm)
