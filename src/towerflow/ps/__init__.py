"""Parameter-server training, by side: `worker/` what a chief or worker runs, `server/` what a ps
task runs (`serve.py`, `python -m towerflow.ps.serve`), `messages.py` what crosses the wire between
them; below them what both use, `layout.py` (which ps task holds what) and `tables/` (embedding
tables whose rows live on the ps tasks, with their row-wise optimizers). Here: the user's names."""

from towerflow.ps.layout import Layout, ShardSpec, plan_layout
from towerflow.ps.tables.hash_embedding import HashEmbedding
from towerflow.ps.tables.row_optimizers import FTRL, RowOptimizer, SparseAdagrad, SparseAdam, SparseSGD, row_optimizer_for

__all__ = [
    "FTRL", "HashEmbedding", "Layout", "RowOptimizer", "ShardSpec", "SparseAdagrad", "SparseAdam", "SparseSGD",
    "plan_layout", "row_optimizer_for",
]
