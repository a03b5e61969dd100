"""Which rows of a ps task's table shards changed since they were last taken: what a delta publishes.

A fixed table keeps one flag per local row (a shard of 500,000 rows costs 0.5 MB, whatever the number of
steps between publishes); a hash table keeps the ids it saw, deduplicated whenever they pile up, and the ids
its evictions removed. Marking runs under the shard service's lock on the training path, so it is one indexed
write per table per push. `take` swaps in a fresh record and hands back the keys marked since the previous
take; `take_evicted` the same for evictions.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from towerflow.ps.tables import TableSpec

_COMPACT_AT = 1 << 20  # a hash table's marked ids deduplicated once this many pile up


class RowChanges:
    """The rows each table shard of one ps task changed since the last `take`."""

    def __init__(self, specs: Dict[str, TableSpec], shard: int):
        self.specs = dict(specs)
        self.shard = shard
        self._flags: Dict[str, torch.Tensor] = {}
        self._ids: Dict[str, List[torch.Tensor]] = {}
        self._pending: Dict[str, int] = {}
        self._evicted: Dict[str, List[torch.Tensor]] = {name: [] for name in self.specs}
        for name in self.specs:
            self._reset(name)

    def _reset(self, name: str) -> None:
        spec = self.specs[name]
        if spec.is_hash:
            self._ids[name], self._pending[name] = [], 0
        else:
            self._flags[name] = torch.zeros(spec.shard_rows(self.shard), dtype=torch.bool)

    def mark(self, table: str, keys: torch.Tensor) -> None:
        """The rows of these local keys (a hash table's ids) changed."""
        if table not in self.specs or not keys.numel():
            return
        if self.specs[table].is_hash:
            self._ids[table].append(keys.long().clone())
            self._pending[table] += keys.numel()
            if self._pending[table] >= _COMPACT_AT:
                unique = torch.unique(torch.cat(self._ids[table]))
                self._ids[table], self._pending[table] = [unique], unique.numel()
        else:
            self._flags[table].index_fill_(0, keys.long(), True)

    def mark_evicted(self, table: str, ids: torch.Tensor) -> None:
        """These ids of a hash table lost their rows (an eviction)."""
        if table in self.specs and ids.numel():
            self._evicted[table].append(ids.long().clone())

    def take_evicted(self, table: str) -> torch.Tensor:
        """The ids evicted since the previous `take_evicted`, sorted and unique (some may have been admitted again
        since); starts over."""
        ids, self._evicted[table] = self._evicted[table], []
        return torch.unique(torch.cat(ids)) if ids else torch.zeros(0, dtype=torch.int64)

    def take(self, table: str) -> torch.Tensor:
        """The local keys (a hash table's ids) marked since the previous take, sorted and unique; starts over."""
        if self.specs[table].is_hash:
            ids = self._ids[table]
            keys = torch.unique(torch.cat(ids)) if ids else torch.zeros(0, dtype=torch.int64)
        else:
            keys = self._flags[table].nonzero().squeeze(1)
        self._reset(table)
        return keys
