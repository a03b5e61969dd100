"""The synthetic click log written as files to train from: Parquet, Arrow IPC or Criteo's TSV, atomically.

Parquet and Arrow keep the dense floats and the ids as they are (Criteo's column names, and a metadata
key that tells a reader the floats need no transform); Criteo TSV writes what Criteo has: counts and hex.
"""

from __future__ import annotations

import os
from typing import List, Sequence, Tuple

import numpy as np
import torch

from towerflow._io import atomic_write
from towerflow.data.file_formats import pyarrow
from towerflow.data.schema import CRITEO_CATS, CRITEO_DENSE
from towerflow.errors import DataError

COLUMNS = ["label", *CRITEO_DENSE, *CRITEO_CATS]


def write_ctr(directory: str, batches: Sequence[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]], fmt: str,
              row_group: int = 4096) -> str:
    """One file of `batches` (dense, cats, labels) in `fmt`, written atomically; its path.

    Parquet and Arrow keep the dense floats and the ids as they are (towerflow's columns). Criteo TSV
    writes what Criteo has: counts, whose log(1 + count) is the dense value shifted by 3 (so nearly all
    are positive; a shift the model's bias absorbs), and the ids in hex.
    """
    pa = pyarrow()
    dense = torch.cat([b[0] for b in batches]).numpy()
    cats = torch.cat([b[1] for b in batches]).numpy()
    labels = torch.cat([b[2] for b in batches]).numpy()
    os.makedirs(directory, exist_ok=True)
    n = len([f for f in os.listdir(directory) if not f.startswith(".")])
    path = os.path.join(directory, f"part-{n:05d}.{ {'parquet': 'parquet', 'arrow': 'arrow', 'criteo': 'tsv'}[fmt] }")
    tmp = path + ".tmp"
    if fmt == "criteo":
        counts = np.rint(np.expm1(np.clip(dense.astype(np.float64) + 3.0, 0.0, None))).astype(np.int64)
        arrays = [pa.array(labels.astype(np.int8))] + [pa.array(counts[:, j]) for j in range(len(CRITEO_DENSE))] + \
                 [pa.array(np.char.mod("%08x", cats[:, j])) for j in range(len(CRITEO_CATS))]
        pa.csv.write_csv(pa.Table.from_arrays(arrays, names=COLUMNS), tmp, write_options=pa.csv.WriteOptions(
            include_header=False, delimiter="\t", quoting_style="none"))
    else:
        arrays = [pa.array(labels.astype(np.int8))] + [pa.array(dense[:, j]) for j in range(len(CRITEO_DENSE))] + \
                 [pa.array(cats[:, j]) for j in range(len(CRITEO_CATS))]
        table = pa.Table.from_arrays(arrays, names=COLUMNS).replace_schema_metadata({"towerflow": "ctr"})
        if fmt == "parquet":
            pa.parquet.write_table(table, tmp, row_group_size=row_group)
        else:
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                for batch in table.to_batches(max_chunksize=row_group):
                    writer.write_batch(batch)
    os.replace(tmp, path)
    return path


def write_ctr_files(data, directory: str, format: str, files: int = 8, records_per_file: int = 16384,
                    row_group: int = 4096, seed: int = 1) -> Tuple[List[str], str]:
    """The synthetic click log `data` (`towerflow.data.synthetic_ctr`) as files a user can train from:
    `files` training files of `records_per_file` records in DIRECTORY/train (drawn from one stream of
    `seed`) and its held-out set in DIRECTORY/test, so the planted model's best AUC still applies.
    Returns (training files, test folder)."""
    if format not in ("parquet", "arrow", "criteo"):
        raise DataError(f"format={format!r}: expected parquet, arrow or criteo")
    return _write_split(data, directory, files, records_per_file, seed,
                        lambda folder, batch: write_ctr(folder, [batch], format, row_group))


def write_named_ctr_files(data, directory: str, files: int = 8, records_per_file: int = 16384,
                          row_group: int = 4096, lists: int = 1, seed: int = 1) -> Tuple[List[str], str]:
    """The synthetic click log as a warehouse export would hold it: Parquet with columns of their own names.

    `clk` the label; `f0`.. the dense features (floats); `userid` the first table's ids as text (`u123`);
    `adgroup_id` the second's as integers; `cat2`.. the middle tables' integers; and `lists` list columns
    `hist0`.. each holding the ids of two more tables in one list (a record's second id is left out for a
    third of the records, so the lists vary in length). Needs `data` with at least 2 + 2 * lists tables.
    DIRECTORY/train gets the files, DIRECTORY/test the held-out set. Returns (training files, test folder).
    """
    if data.num_tables < 2 + 2 * lists:
        raise DataError(f"{data.num_tables} tables for {lists} list columns: expected at least {2 + 2 * lists}")
    return _write_split(data, directory, files, records_per_file, seed,
                        lambda folder, batch: _write_named(folder, list(batch), lists, row_group))


def _write_split(data, directory: str, files: int, records_per_file: int, seed: int, write):
    """`files` files of `records_per_file` records of one stream in DIRECTORY/train, the held-out set in
    DIRECTORY/test, each written by `write(folder, (dense, cats, labels))`; (training files, test folder)."""
    train, test = os.path.join(directory, "train"), os.path.join(directory, "test")
    stream = data.batches(min(records_per_file, 8192), seed=seed)
    paths = []
    for _ in range(files):
        chunks, have = [], 0
        while have < records_per_file:
            chunk = tuple(t[: records_per_file - have] for t in next(stream))
            chunks.append(chunk)
            have += len(chunk[2])
        paths.append(write(train, tuple(torch.cat([c[i] for c in chunks]) for i in range(3))))
    write(test, data.test_set())
    return paths, test


def _write_named(directory: str, batch, lists: int, row_group: int) -> str:
    pa = pyarrow()
    dense, cats, labels = (t.numpy() for t in batch)
    n, tables = cats.shape
    middle = tables - 2 * lists
    columns = {"clk": pa.array(labels.astype(np.int8))}
    columns.update({f"f{j}": pa.array(dense[:, j]) for j in range(dense.shape[1])})
    columns["userid"] = pa.array(np.char.add("u", cats[:, 0].astype(str)))
    columns["adgroup_id"] = pa.array(cats[:, 1])
    columns.update({f"cat{t}": pa.array(cats[:, t]) for t in range(2, middle)})
    for k in range(lists):
        a, b = cats[:, middle + 2 * k], cats[:, middle + 2 * k + 1]
        counts = np.where(np.arange(n) % 3 == 0, 1, 2)
        values = np.stack([a, b], 1).reshape(-1)[np.stack([np.ones(n, bool), counts == 2], 1).reshape(-1)]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        columns[f"hist{k}"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    os.makedirs(directory, exist_ok=True)
    count = len([f for f in os.listdir(directory) if not f.startswith(".")])
    path = os.path.join(directory, f"part-{count:05d}.parquet")
    with atomic_write(path) as f:
        pa.parquet.write_table(pa.table(columns), f, row_group_size=row_group)
    return path
