"""`EmbeddingStore`: the rows a training job publishes, applied in order and looked up by id.

Each ps task publishes its part (its shard of every table, its dense shards) as numbered snapshots and
deltas (`ps/tables/delta_log.py`). The store reads every task's manifest, loads the newest snapshot of
each, then applies the deltas after it in order. The rules that make it safe to call again and again:

* a publication is applied once: one numbered at or below the last applied of its task changes nothing;
* a delta applies only on top of its predecessor: one that skips a number is refused (`refresh` then
  starts that task over from its newest snapshot);
* a snapshot replaces the task's part whole (rows evicted since are gone); a delta drops the hash rows it
  names as evicted (those the store does not hold change nothing), then writes its rows.

Within a task every row of a publication carries the publication's number as its version.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Dict, List, Optional

import torch

from towerflow.errors import ParameterServerError
from towerflow.ps.tables import delta_log, row_files
from towerflow.ps.tables.delta_log import SNAPSHOT, Publication


class PublicationGapError(ParameterServerError):
    """Raised when a delta does not follow the publication applied before it (one was skipped or lost)."""


@dataclasses.dataclass
class _Rows:
    """One table's rows from one ps task: sorted ids, their vectors and versions."""

    ids: torch.Tensor
    values: torch.Tensor
    versions: torch.Tensor

    @classmethod
    def empty(cls, dim: int) -> "_Rows":
        return cls(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dim), torch.zeros(0, dtype=torch.int64))

    def drop(self, ids: torch.Tensor) -> None:
        """Remove the rows of these ids (ids not held change nothing)."""
        if ids.numel() and self.ids.numel():
            keep = ~torch.isin(self.ids, ids)
            self.ids, self.values, self.versions = self.ids[keep], self.values[keep], self.versions[keep]

    def upsert(self, ids: torch.Tensor, values: torch.Tensor, versions: torch.Tensor) -> None:
        """Write rows whose version is not older than the one held; new ids are added."""
        if not ids.numel():
            return
        n = self.ids.numel()
        at = torch.searchsorted(self.ids, ids).clamp(max=max(n - 1, 0))
        found = (self.ids[at] == ids) if n else torch.zeros_like(ids, dtype=torch.bool)
        update = found & (versions >= (self.versions[at] if n else versions))
        rows = at[update]
        self.values[rows] = values[update]
        self.versions[rows] = versions[update]
        new = ~found
        if bool(new.any()):
            ids_all = torch.cat([self.ids, ids[new]])
            order = torch.argsort(ids_all)
            self.ids = ids_all[order]
            self.values = torch.cat([self.values, values[new]])[order]
            self.versions = torch.cat([self.versions, versions[new]])[order]


class EmbeddingStore:
    """The published tables of one model, as of the newest publications applied; `lookup(table, ids)`."""

    def __init__(self, publish_dir: str, model: str = "model"):
        self.root = os.path.join(publish_dir, model)
        self.applied: Dict[int, int] = {}  # ps task -> the number of the last publication applied
        self.global_steps: Dict[int, int] = {}
        self._rows: Dict[str, Dict[int, _Rows]] = {}  # table -> ps task -> rows
        self._dense: Dict[int, Dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._follow: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # ---- reading the publications
    def tasks(self) -> List[int]:
        """The ps tasks that published, by their folder."""
        if not os.path.isdir(self.root):
            return []
        return sorted(int(n.split("-", 1)[1]) for n in os.listdir(self.root) if n.startswith("ps-"))

    def refresh(self) -> int:
        """Apply every publication announced since the last call; returns how many were applied."""
        applied = 0
        for task in self.tasks():
            folder = delta_log.task_dir(os.path.dirname(self.root), os.path.basename(self.root), task)
            entries = delta_log.read_manifest(folder)
            pending = [e for e in entries if e.seq > self.applied.get(task, 0)]
            if not pending:
                continue
            if pending[0].kind != SNAPSHOT and pending[0].seq != self.applied.get(task, 0) + 1:
                pending = _from_newest_snapshot(entries)  # what we held was pruned away: start over
            for entry in pending:
                self.apply(task, folder, entry)
                applied += 1
        return applied

    def apply(self, task: int, folder: str, entry: Publication) -> bool:
        """Apply one publication of `task`; False when it was applied already (or is older than what is held)."""
        with self._lock:
            last = self.applied.get(task, 0)
            if entry.seq <= last:
                return False
            if entry.kind != SNAPSHOT and entry.seq != last + 1:
                raise PublicationGapError(
                    f"ps task {task}: delta {entry.seq} does not follow publication {last} (applied last); apply "
                    f"{last + 1} first, or start from a snapshot (refresh() does)")
            for table, rel in entry.tables.items():
                ids, values, versions = row_files.read_rows(os.path.join(folder, rel))
                by_task = self._rows.setdefault(table, {})
                if entry.kind == SNAPSHOT or task not in by_task:
                    by_task[task] = _Rows.empty(values.shape[1])
                if table in entry.evicted:
                    by_task[task].drop(row_files.read_ids(os.path.join(folder, entry.evicted[table])))
                by_task[task].upsert(ids, values, versions)
            if entry.dense is not None:
                self._dense[task] = delta_log.read_dense(os.path.join(folder, entry.dense))
            self.applied[task] = entry.seq
            self.global_steps[task] = entry.global_step
            return True

    # ---- answers
    @property
    def tables(self) -> List[str]:
        return sorted(self._rows)

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` [n, dim] (zeros for ids the store does not hold)."""
        with self._lock:
            parts = self._rows.get(table)
            if parts is None:
                raise KeyError(f"no table {table!r} was published; the store has {self.tables}")
            ids = ids.reshape(-1).long()
            dim = next(iter(parts.values())).values.shape[1]
            out = torch.zeros(ids.numel(), dim)
            for rows in parts.values():
                n = rows.ids.numel()
                if not n:
                    continue
                at = torch.searchsorted(rows.ids, ids).clamp(max=n - 1)
                found = rows.ids[at] == ids
                out[found] = rows.values[at[found]]
            return out

    def table(self, table: str) -> tuple:
        """(ids sorted, rows) of a whole table, as held now (for checks and small tables)."""
        with self._lock:
            parts = list(self._rows[table].values())
            ids = torch.cat([p.ids for p in parts])
            values = torch.cat([p.values for p in parts])
            order = torch.argsort(ids)
            return ids[order], values[order]

    def dense(self) -> Dict[str, torch.Tensor]:
        """The dense shards, by shard name (`x/part_1` for a part of a row-sharded variable)."""
        with self._lock:
            out: Dict[str, torch.Tensor] = {}
            for shards in self._dense.values():
                out.update(shards)
            return out

    # ---- following a directory
    def follow(self, interval: float = 1.0) -> "EmbeddingStore":
        """Apply new publications every `interval` s in a daemon thread, until `close()`."""
        def loop():
            while not self._stop.wait(interval):
                self.refresh()

        self.refresh()
        self._follow = threading.Thread(target=loop, name="towerflow-store-follow", daemon=True)
        self._follow.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._follow is not None:
            self._follow.join()


def _from_newest_snapshot(entries: List[Publication]) -> List[Publication]:
    starts = [i for i, e in enumerate(entries) if e.kind == SNAPSHOT]
    return entries[starts[-1]:] if starts else []
