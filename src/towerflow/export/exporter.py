"""`export_run`: a run's checkpoint turned into what inference and serving read, written all or nothing.

The export folder holds `model.pt` (the model's `state_dict` with every table put back whole, loadable
by the model's class in plain PyTorch), each table's rows as Parquet `(id, vector)` files, one per ps
shard, for a serving store, and, for hash tables, `hash_tables.pt` with `hash_lookup.py`, the
plain-torch module that looks their ids up. Everything is written into a hidden folder beside the
target; `export.json` is written last, and only then is the folder renamed into place, so a crash
leaves the previous export (or none), never a half of one under the target's name.

A fixed table is assembled in a file-backed tensor beside the export (`torch.from_file`), shard by
shard from the memory-mapped checkpoint, so a table larger than memory is paged through, not held.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

from towerflow import _files
from towerflow._io import atomic_write, fsync_directory
from towerflow.errors import CheckpointError
from towerflow.export.saved_run import SavedRun, open_run
from towerflow.ps.tables import row_files

FORMAT = 1


@dataclasses.dataclass(frozen=True)
class ExportInfo:
    """What an export holds: where, from which checkpoint, and each table's rows and files."""

    out: str
    step: int
    checkpoint: str
    num_ps: int
    tables: Dict[str, Dict[str, Any]]

    @property
    def model_file(self) -> str:
        return os.path.join(self.out, _files.EXPORT_MODEL)


def export_run(run_dir: str, out: str, step: Optional[int] = None, overwrite: bool = False,
               chunk_rows: int = row_files.CHUNK_ROWS) -> ExportInfo:
    """Export the newest intact checkpoint of `run_dir` (or that of `step`) to the folder `out`."""
    out = os.path.abspath(out)
    _check_target(out, overwrite)
    run = open_run(run_dir, step)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(partial, 0o777 & ~umask)  # a folder as mkdir makes it: serving may run as another user
    try:
        manifest = _write(run, partial, chunk_rows)
        with atomic_write(os.path.join(partial, _files.EXPORT_MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        _swap_in(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return ExportInfo(out, manifest["step"], manifest["checkpoint"], manifest["num_ps"], manifest["tables"])


def read_export(path: str) -> ExportInfo:
    """An export's manifest, checked: every file it names is there."""
    manifest_path = os.path.join(path, _files.EXPORT_MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path!r} is not a complete export: it has no {_files.EXPORT_MANIFEST} (an export "
                              "interrupted before its end has none); export the run again") from None
    named = [_files.EXPORT_MODEL] + [f for t in manifest["tables"].values() for f in t["files"]]
    missing = [f for f in named if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise CheckpointError(f"export {path!r} lacks files its manifest names: {missing[:5]}; export the run again")
    return ExportInfo(os.path.abspath(path), manifest["step"], manifest["checkpoint"], manifest["num_ps"],
                      manifest["tables"])


def _check_target(out: str, overwrite: bool) -> None:
    if not os.path.exists(out):
        return
    if not os.path.isdir(out):
        raise CheckpointError(f"--out {out!r} is a file; give a folder for the export")
    is_export = os.path.exists(os.path.join(out, _files.EXPORT_MANIFEST))
    if is_export and not overwrite:
        raise CheckpointError(f"--out {out!r} already holds an export; pass --overwrite (overwrite=True) to replace it, "
                              "or give another folder")
    if not is_export and os.listdir(out):
        raise CheckpointError(f"--out {out!r} is a folder that holds other files; give an empty or new folder")


def _swap_in(partial: str, out: str) -> None:
    """Rename the finished folder to `out`; a previous export there goes only once the new one is in place."""
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
        os.rmdir(old)
        os.replace(out, old)
    os.replace(partial, out)
    fsync_directory(os.path.dirname(out))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _copied_into(whole: Optional[torch.Tensor], chunks, dtype: torch.dtype):
    """The chunks, each also copied into `whole` (a fixed table's file-backed tensor) on the way: one pass."""
    for ids, values in chunks:
        if whole is not None:
            whole.index_copy_(0, ids, values.to(dtype))
        yield ids, values


def _write(run: SavedRun, folder: str, chunk_rows: int) -> dict:
    state = dict(run.model_state)
    state.update(run.dense_values())
    tables: Dict[str, Dict[str, Any]] = {}
    backing: List[str] = []
    hash_tables: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, spec in run.table_specs().items():
        files, ids_seen, pieces = [], 0, []
        whole = None
        if not spec.is_hash:
            path = os.path.join(folder, f".{name}.rows")
            backing.append(path)
            whole = torch.from_file(path, shared=True, size=spec.rows * spec.dim, dtype=spec.dtype).view(spec.rows,
                                                                                                        spec.dim)
        for shard in run.table_shards(name):
            rel = _files.export_table_file(name, shard.shard)
            ids_seen += row_files.write_rows(os.path.join(folder, rel), spec.dim,
                                             _copied_into(whole, shard.chunks(chunk_rows), spec.dtype))
            files.append(rel)
            if whole is None:
                pieces.append((shard.hash_ids.clone(), shard.values.clone()))
        if whole is not None:
            state[f"{name}.weight"] = whole
        else:
            ids = torch.cat([p[0] for p in pieces]) if pieces else torch.zeros(0, dtype=torch.int64)
            weight = torch.cat([p[1] for p in pieces]) if pieces else torch.zeros(0, spec.dim, dtype=spec.dtype)
            order = torch.argsort(ids)
            hash_tables[name] = {"ids": ids[order], "weight": weight[order]}
        tables[name] = {"kind": "hash" if spec.is_hash else "fixed", "rows": ids_seen, "dim": spec.dim,
                        "dtype": str(spec.dtype).replace("torch.", ""), "partition_strategy": spec.partition_strategy,
                        "num_shards": spec.num_shards, "files": files,
                        "state_dict_key": None if spec.is_hash else f"{name}.weight"}
    with atomic_write(os.path.join(folder, _files.EXPORT_MODEL)) as f:
        torch.save(state, f)
    del state
    for path in backing:
        os.unlink(path)
    if hash_tables:
        with atomic_write(os.path.join(folder, _files.EXPORT_HASH_TABLES)) as f:
            torch.save(hash_tables, f)
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hash_lookup.py")
        with open(source) as src, atomic_write(os.path.join(folder, _files.EXPORT_HASH_LOOKUP), "w") as f:
            f.write(src.read())
    return {"format": FORMAT, "step": run.step, "checkpoint": run.info.path, "num_ps": run.num_ps,
            "time": time.time(), "model": _files.EXPORT_MODEL,
            "hash_tables": _files.EXPORT_HASH_TABLES if hash_tables else None, "tables": tables}
