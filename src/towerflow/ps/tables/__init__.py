"""Embedding tables on the ps tasks: which table rows live where, and how an id finds its row.

TF 1.x kept an embedding table as a partitioned variable on the ps tasks and looked rows up with
`tf.nn.embedding_lookup(params, ids, partition_strategy=...)`:

* `"mod"` (TF's default): id `g` lives on shard `g % P` at local row `g // P`;
* `"div"`: contiguous ranges, the first `rows % P` shards one row longer; id `g` lives in the
  range that holds it;
* `"hash"` (a vocabulary that grows, `towerflow.ps.HashEmbedding`): any int64 id, on shard
  `id mod P`, stored under the id itself (the shard's `HashRows` maps ids to slots).

Shard `s` of every table lives on ps task `s`. A `TableSpec` is plain data: the chief sends it
to the ps tasks, every worker routes ids with it, and a checkpoint keeps it so that a table saved
with N ps tasks can be put back onto M (`global_ids` undoes `route`). It is defined here, in the
package itself, because checkpoints pickle it by this path.

The rest of the package is what both sides share about tables: the row stores a ps task holds
(`table_shards.py` over `rows.py` `FixedRows` and `vocabulary.py` `HashRows`), the row-wise
optimizers that train them (`row_optimizers.py`), and the growing table's module
(`hash_embedding.py`). Nothing here imports the worker or the ps side.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from towerflow.errors import LayoutError, did_you_mean

PARTITION_STRATEGIES = ("mod", "div")


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table: its shape, how its rows are split over the ps tasks, how the ps creates them."""

    name: str
    rows: Optional[int]  # None: a hash table (the vocabulary grows)
    dim: int
    dtype: torch.dtype
    num_shards: int
    partition_strategy: str = "mod"  # "mod" | "div" | "hash"
    init_std: float = 1.0  # rows drawn N(0, init_std) on the ps when the worker sends no values
    seed: int = 0
    admit_after: int = 1  # hash tables: sightings before an id gets a row
    evict_after: Optional[int] = None  # hash tables: global steps untouched before a row is removed
    forget_after: Optional[int] = None  # hash tables: global steps unseen before an id's pending sightings go

    def __post_init__(self):
        allowed = PARTITION_STRATEGIES + ("hash",)
        if self.partition_strategy not in allowed:
            raise LayoutError(f"partition_strategy={self.partition_strategy!r}: expected one of {PARTITION_STRATEGIES}"
                              f"{did_you_mean(str(self.partition_strategy), allowed)}")
        if (self.rows is None) != (self.partition_strategy == "hash"):
            raise LayoutError(f"table {self.name!r}: a hash table has no row count and a fixed table needs one")
        if self.num_shards < 1 or (self.rows is not None and self.rows < 1):
            raise LayoutError(f"table {self.name!r}: {self.rows} rows in {self.num_shards} shards; expected at least one each")

    @property
    def is_hash(self) -> bool:
        return self.partition_strategy == "hash"

    def shard_name(self, shard: int) -> str:
        """`emb/part_1`, TF's name for a part of a partitioned variable."""
        return f"{self.name}/part_{shard}"

    # ---- fixed tables: how many rows each shard holds
    def _div(self) -> Tuple[int, int]:
        return divmod(self.rows, self.num_shards)

    def shard_rows(self, shard: int) -> int:
        """The rows shard `shard` holds (0 for a hash table: it grows)."""
        if self.rows is None:
            return 0
        if self.partition_strategy == "mod":
            return (self.rows - shard + self.num_shards - 1) // self.num_shards
        base, extra = self._div()
        return base + (1 if shard < extra else 0)

    def shard_start(self, shard: int) -> int:
        """div: the first global id of a shard."""
        base, extra = self._div()
        return shard * base + min(shard, extra)

    # ---- routing
    def route(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(shard, local key) of every id: the local row of a fixed table, the id itself for a hash table."""
        ids = ids.long()
        p = self.num_shards
        if self.partition_strategy == "hash":
            return torch.remainder(ids, p), ids
        if self.partition_strategy == "mod":
            return ids % p, ids // p
        base, extra = self._div()
        boundary = extra * (base + 1)
        if base == 0:  # fewer rows than shards: every row is its own shard
            return ids.clone(), torch.zeros_like(ids)
        shard = torch.where(ids < boundary, ids // (base + 1), extra + (ids - boundary) // base)
        start = shard * base + torch.minimum(shard, torch.tensor(extra))
        return shard, ids - start

    def global_ids(self, shard: int, local: torch.Tensor) -> torch.Tensor:
        """The global ids of a shard's local rows (the inverse of `route`)."""
        local = local.long()
        if self.partition_strategy == "hash":
            return local
        if self.partition_strategy == "mod":
            return local * self.num_shards + shard
        return local + self.shard_start(shard)

    def check_ids(self, ids: torch.Tensor) -> None:
        """Refuse ids outside a fixed table's rows, naming the table and the offending id."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise LayoutError(f"table {self.name!r} was looked up with {ids.dtype} ids; expected integer (int64) ids")
        if self.rows is None or ids.numel() == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.rows:
            bad = low if low < 0 else high
            raise LayoutError(f"table {self.name!r} has {self.rows} rows; id {bad} is out of range [0, {self.rows}). "
                              "Map ids into the table's range, or use towerflow.ps.HashEmbedding for arbitrary ids")

    def wire_dtype(self) -> torch.dtype:
        """Local keys travel as int32 when every shard fits (half the bytes of int64), else int64."""
        if self.rows is not None and self.shard_rows(0) < 2 ** 31:
            return torch.int32
        return torch.int64

    @property
    def nbytes(self) -> int:
        """The table's values in bytes (0 for a hash table)."""
        return (self.rows or 0) * self.dim * torch.empty((), dtype=self.dtype).element_size()
