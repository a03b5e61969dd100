"""The table shards one ps task holds for one model: reads, row pushes, and the rows a sync update waits on.

Shard `task` of every table lives here, each in its own row store (`rows.py`: `FixedRows` for a
fixed table, `HashRows` for a growing vocabulary) with its row-wise optimizer
(`row_optimizers.py`). The shard service calls this under its lock and decides, through the
update policy, whether a push's rows are applied now, held for the aggregated update of a sync
step (their sum kept per table, coalesced when applied), or dropped with a stale push.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from towerflow.errors import ParameterServerError
from towerflow.ps.tables import TableSpec
from towerflow.ps.tables.row_changes import RowChanges
from towerflow.ps.tables.row_optimizers import RowOptimizer
from towerflow.ps.tables.rows import FixedRows
from towerflow.ps.tables.vocabulary import HashRows


def _seed(spec: TableSpec, shard: int) -> int:
    """A seed per (table, shard) that every process derives alike."""
    digest = hashlib.sha256(f"{spec.seed}/{spec.name}/{shard}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def initial_rows(spec: TableSpec, shard: int) -> torch.Tensor:
    """A fixed table shard's first values, drawn N(0, init_std) here on the ps (the worker never held them)."""
    generator = torch.Generator().manual_seed(_seed(spec, shard))
    rows = torch.randn(spec.shard_rows(shard), spec.dim, generator=generator, dtype=torch.float32)
    if spec.init_std != 1.0:
        rows.mul_(spec.init_std)
    return rows.to(spec.dtype)


def make_store(spec: TableSpec, shard: int, optimizer: RowOptimizer, values: Optional[torch.Tensor] = None):
    """The row store of one shard: values sent by the chief, or drawn here."""
    if spec.is_hash:
        return HashRows(spec.dim, optimizer, dtype=spec.dtype, init_std=spec.init_std, seed=_seed(spec, shard),
                        admit_after=spec.admit_after, evict_after=spec.evict_after, forget_after=spec.forget_after)
    if values is None:
        values = initial_rows(spec, shard)
    elif tuple(values.shape) != (spec.shard_rows(shard), spec.dim):
        raise ParameterServerError(f"{spec.shard_name(shard)}: got values of shape {tuple(values.shape)}, expected "
                                   f"{(spec.shard_rows(shard), spec.dim)}")
    return FixedRows(values.to(spec.dtype).contiguous(), optimizer)


class TableShards:
    """Shard `task` of every table of one model, on ps task `task`."""

    def __init__(self, task: int, specs: Sequence[TableSpec], optimizer: RowOptimizer,
                 values: Optional[Dict[str, torch.Tensor]] = None):
        values = values or {}
        self.task = task
        self.specs = {s.name: s for s in specs}
        self.optimizer = optimizer
        self.stores = {s.name: make_store(s, task, optimizer, values.get(s.name)) for s in specs}
        self._held: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = {}  # sync: rows of held pushes
        self.changes: Optional[RowChanges] = None  # publishing on: the rows changed since the last publish
        self.loads = 0  # restores so far: after one, a publisher writes a full snapshot

    def __bool__(self) -> bool:
        return bool(self.stores)

    def _store(self, table: str):
        store = self.stores.get(table)
        if store is None:
            raise ParameterServerError(f"/job:ps/task:{self.task} holds no table {table!r} (it has {sorted(self.stores)}); "
                                       "every task must build the same model")
        return store

    # ---- reads and pushes
    def needs_lock(self, tables: Sequence[str]) -> bool:
        """Whether reading these tables changes them (a hash table counts sightings and admits ids)."""
        return any(self.specs[t].is_hash for t in tables if t in self.specs)

    def read(self, tables: Sequence[str], keys: Sequence[torch.Tensor], step: int, count: bool = True) -> List[torch.Tensor]:
        """The rows of each table's keys (a hash table counts the sighting and may admit the id, unless `count` is
        False: a read sent again)."""
        out = []
        for table, k in zip(tables, keys):
            store = self._store(table)
            if self.specs[table].is_hash:
                out.append(store.read(k, step, count))
                if count and self.changes is not None:  # a read may admit an id: a new row
                    self.changes.mark(table, k)
            else:
                out.append(store.read(k))
        return out

    def apply(self, tables: Sequence[str], keys: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              lr: Optional[float], lr_scale: float, step: int) -> None:
        """Apply one push's rows now (async, ssp, or a sync update of one gradient)."""
        for table, k, g in zip(tables, keys, grads):
            self._apply_one(table, k, g, lr, lr_scale, step)

    def _apply_one(self, table, keys, grads, lr, lr_scale, step) -> None:
        store = self._store(table)
        if self.specs[table].is_hash:
            store.apply(keys, grads, step, lr=lr, lr_scale=lr_scale)
        else:
            store.apply(keys, grads, lr=lr, lr_scale=lr_scale)
        if self.changes is not None:
            self.changes.mark(table, keys)

    def hold(self, tables: Sequence[str], keys: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """Keep a sync push's rows for the aggregated update of this step."""
        for table, k, g in zip(tables, keys, grads):
            self._store(table)
            self._held.setdefault(table, []).append((k.long(), g))

    def apply_held(self, n: int, lr: Optional[float], lr_scale: float, step: int) -> None:
        """The aggregated update: every held row's gradient summed per row and divided by `n` (the mean over
        the `n` workers of the update, as for the dense variables), then applied."""
        held, self._held = self._held, {}
        for table, parts in held.items():
            keys = torch.cat([k for k, _ in parts])
            grads = torch.cat([g for _, g in parts])
            unique, inverse = torch.unique(keys, return_inverse=True)
            summed = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)
            self._apply_one(table, unique, summed.div_(float(n)), lr, lr_scale, step)

    def drop_held(self) -> None:
        self._held = {}

    def evict(self, step: int) -> int:
        """Hash tables: remove rows untouched for their `evict_after` steps; how many went (a publisher is told
        which)."""
        gone = 0
        for name, store in self.stores.items():
            if self.specs[name].is_hash:
                ids = store.evict_ids(step)
                if ids.numel() and self.changes is not None:
                    self.changes.mark_evicted(name, ids)
                gone += ids.numel()
        return gone

    # ---- checkpoints and inspection
    def state_dict(self) -> Dict[str, dict]:
        """Each table shard's state, with its spec (a checkpoint restored onto another number of ps tasks
        reshards by it)."""
        return {name: {"spec": self.specs[name], "shard": self.task, "state": store.state_dict()}
                for name, store in self.stores.items()}

    def load_state_dict(self, state: Dict[str, dict]) -> None:
        missing = sorted(set(self.stores) - set(state))
        if missing:
            raise ParameterServerError(f"the checkpoint has no state for tables {missing} on /job:ps/task:{self.task}")
        for name, store in self.stores.items():
            store.load_state_dict(state[name]["state"])
        self._held = {}
        self.loads += 1

    # ---- publishing (ps/server/publisher.py)
    def track_changes(self) -> RowChanges:
        """Start recording the rows each push changes (call under the service's lock)."""
        self.changes = RowChanges(self.specs, self.task)
        return self.changes

    @property
    def rows_held(self) -> int:
        """Rows of every table shard held now (what a snapshot holds)."""
        return sum(store.rows_held for store in self.stores.values())

    def fixed_values(self, table: str) -> torch.Tensor:
        """A fixed table shard's live values (not a copy: read it in chunks; rows changed meanwhile are marked)."""
        return self._store(table).values

    def rows_now(self, table: str, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(global ids, rows) of these local keys, copies; for a hash table only the ids that still have rows."""
        spec, store = self.specs[table], self._store(table)
        if spec.is_hash:
            return store.peek(keys)
        return spec.global_ids(self.task, keys), store.values.index_select(0, keys)

    def values(self) -> Dict[str, torch.Tensor]:
        """This task's shard of every fixed table, by table name (copies), for checks."""
        return {n: s.read(torch.arange(s.rows_held)) for n, s in self.stores.items() if not self.specs[n].is_hash}

    def metrics(self) -> Dict[str, dict]:
        out = {}
        for name, store in self.stores.items():
            m = dict(store.metrics()) if hasattr(store, "metrics") else {"rows": store.rows_held}
            out[name] = m
        return out

    @property
    def nbytes(self) -> int:
        return sum(store.nbytes for store in self.stores.values())
