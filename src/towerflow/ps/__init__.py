"""Parameter-server training: variable layout on ps tasks, the update policies, the ps-side service,
and embedding tables whose rows live on the ps tasks (with their row-wise optimizers)."""

from towerflow.ps.layout import Layout, ShardSpec, plan_layout
from towerflow.ps.tables.hash_embedding import HashEmbedding
from towerflow.ps.tables.row_optimizers import FTRL, RowOptimizer, SparseAdagrad, SparseAdam, SparseSGD, row_optimizer_for

__all__ = [
    "FTRL", "HashEmbedding", "Layout", "RowOptimizer", "ShardSpec", "SparseAdagrad", "SparseAdam", "SparseSGD",
    "plan_layout", "row_optimizer_for",
]
