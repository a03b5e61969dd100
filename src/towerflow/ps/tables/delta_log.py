"""One ps task's published rows on disk: numbered snapshots and deltas, and the manifest that announces them.

    PUBLISH_DIR/MODEL/ps-0/manifest.json                 the announced publications, oldest first
    PUBLISH_DIR/MODEL/ps-0/00000007-delta/TABLE.parquet  rows (id, vector, version=7) changed since publication 6
    PUBLISH_DIR/MODEL/ps-0/00000007-delta/TABLE.evicted.parquet  hash tables: ids (id) evicted since 6, if any
    PUBLISH_DIR/MODEL/ps-0/00000007-delta/dense.parquet  this task's dense shards, whole (name, dtype, shape, values)

Every file is written atomically, and a publication is announced (the manifest rewritten, atomically) only
once all of its files are in place: a reader that goes by the manifest never opens a partial file. A
publication's number follows the last announced one, also after the ps task restarts (the log is read
back), so the versions have no gap; a snapshot holds every live row, a delta the rows changed since the
publication before it and the ids whose rows were evicted since (none of them has a row in the delta). The publisher (`ps/server/publisher.py`) writes it; `towerflow.serving` reads it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from towerflow import _files
from towerflow._io import atomic_write
from towerflow.errors import ParameterServerError
from towerflow.ps.tables import row_files

SNAPSHOT, DELTA = "snapshot", "delta"
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Publication:
    """One announced snapshot or delta of one ps task: its number, kind, global step, files and row counts."""

    seq: int
    kind: str
    global_step: int
    time: float
    tables: Dict[str, str]  # table -> file, relative to the task's folder
    rows: Dict[str, int]
    dense: Optional[str]
    seconds: float = 0.0  # writing its files took this long
    evicted: Dict[str, str] = dataclasses.field(default_factory=dict)  # hash table -> file of the ids evicted
    evicted_rows: Dict[str, int] = dataclasses.field(default_factory=dict)  # hash table -> how many

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def task_dir(root: str, model: str, task: int) -> str:
    return os.path.join(root, model, _files.publish_task_dir(task))


def read_manifest(folder: str) -> List[Publication]:
    """The publications announced in a task's folder, oldest first ([] when none yet)."""
    try:
        with open(os.path.join(folder, _files.PUBLISH_MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return []
    return [Publication(**entry) for entry in manifest["publications"]]


class DeltaLog:
    """The writer of one ps task's publications (one writer per folder: the ps task that holds the part)."""

    periodic_snapshots = True  # a reader starts from a snapshot and reads the deltas after it: keep that short

    def __init__(self, root: str, model: str, task: int, keep_snapshots: int = 2):
        if keep_snapshots < 1:
            raise ParameterServerError(f"keep_snapshots={keep_snapshots!r}: expected at least 1")
        self.folder = task_dir(root, model, task)
        self.task = task
        self.keep_snapshots = keep_snapshots
        os.makedirs(self.folder, exist_ok=True)
        self.entries = read_manifest(self.folder)
        self._drop_unannounced()

    @property
    def next_seq(self) -> int:
        return self.entries[-1].seq + 1 if self.entries else 1

    def write(self, kind: str, global_step: int, time_s: float, tables: Iterable[Tuple[str, int, Iterable]],
              dense: Dict[str, torch.Tensor], evicted: Optional[Dict[str, torch.Tensor]] = None) -> Publication:
        """Write one publication's files (tables: (name, dim, chunks of (ids, values)); evicted: a delta's hash
        tables' ids evicted since the previous publication), then announce it."""
        if kind not in (SNAPSHOT, DELTA):
            raise ParameterServerError(f"kind={kind!r}: expected {SNAPSHOT!r} or {DELTA!r}")
        started = time.perf_counter()
        seq = self.next_seq
        sub = _files.publish_entry_dir(seq, kind)
        files, rows = {}, {}
        for name, dim, chunks in tables:
            rel = f"{sub}/{name}.parquet"
            rows[name] = row_files.write_rows(os.path.join(self.folder, rel), dim, chunks, version=seq)
            files[name] = rel
        gone, gone_rows = {}, {}
        for name, ids in (evicted or {}).items():
            rel = f"{sub}/{name}{_files.PUBLISH_EVICTED_SUFFIX}"
            gone_rows[name] = row_files.write_ids(os.path.join(self.folder, rel), ids)
            gone[name] = rel
        dense_rel = None
        if dense:
            dense_rel = f"{sub}/{_files.PUBLISH_DENSE}"
            write_dense(os.path.join(self.folder, dense_rel), dense)
        entry = Publication(seq, kind, int(global_step), float(time_s), files, rows, dense_rel,
                            round(time.perf_counter() - started, 4), gone, gone_rows)
        self.entries.append(entry)
        self._announce()
        self._prune()
        return entry

    def _announce(self) -> None:
        with atomic_write(os.path.join(self.folder, _files.PUBLISH_MANIFEST), "w") as f:
            json.dump({"format": FORMAT, "task": self.task, "publications": [e.as_json() for e in self.entries]}, f)

    def _prune(self) -> None:
        """Keep the newest `keep_snapshots` snapshots and the deltas after the oldest of them."""
        snapshots = [i for i, e in enumerate(self.entries) if e.kind == SNAPSHOT]
        if len(snapshots) <= self.keep_snapshots:
            return
        first = snapshots[-self.keep_snapshots]
        gone, self.entries = self.entries[:first], self.entries[first:]
        self._announce()  # unannounced before their files go
        for entry in gone:
            shutil.rmtree(os.path.join(self.folder, _files.publish_entry_dir(entry.seq, entry.kind)), ignore_errors=True)

    def _drop_unannounced(self) -> None:
        """Folders a killed publish left without announcing them, and temporary files, go at start."""
        announced = {_files.publish_entry_dir(e.seq, e.kind) for e in self.entries}
        for name in os.listdir(self.folder):
            path = os.path.join(self.folder, name)
            if os.path.isdir(path) and name not in announced:
                shutil.rmtree(path, ignore_errors=True)
            elif name.startswith(".") and name.endswith(".tmp"):
                os.unlink(path)


def write_dense(path: str, dense: Dict[str, torch.Tensor]) -> None:
    """Dense shards as Parquet rows (name, dtype, shape, values as float64: exact for float32 and narrower)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = list(dense)
    table = pa.table({
        "name": pa.array(names, pa.string()),
        "dtype": pa.array([str(dense[n].dtype).replace("torch.", "") for n in names], pa.string()),
        "shape": pa.array([list(dense[n].shape) for n in names], pa.list_(pa.int64())),
        "values": pa.array([dense[n].detach().reshape(-1).double().numpy() for n in names], pa.list_(pa.float64())),
    })
    with atomic_write(path) as f:
        pq.write_table(table, f)


def read_dense(path: str) -> Dict[str, torch.Tensor]:
    """The dense shards of a publication, by shard name, in their dtype."""
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pydict()
    return {name: torch.tensor(values, dtype=torch.float64).to(getattr(torch, dtype)).reshape(shape)
            for name, dtype, shape, values in zip(table["name"], table["dtype"], table["shape"], table["values"])}
