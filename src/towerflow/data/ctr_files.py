"""The synthetic click log written as files to train from: Parquet, Arrow IPC or Criteo's TSV, atomically.

Parquet and Arrow keep the dense floats and the ids as they are (Criteo's column names, and a metadata
key that tells a reader the floats need no transform); Criteo TSV writes what Criteo has: counts and hex.
"""

from __future__ import annotations

import os
from typing import List, Sequence, Tuple

import numpy as np
import torch

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
    train, test = os.path.join(directory, "train"), os.path.join(directory, "test")
    stream = data.batches(min(records_per_file, 8192), seed=seed)
    paths = []
    for _ in range(files):
        chunks, have = [], 0
        while have < records_per_file:
            chunk = next(stream)
            chunk = tuple(t[: records_per_file - have] for t in chunk)
            chunks.append(chunk)
            have += len(chunk[2])
        paths.append(write_ctr(train, chunks, format, row_group))
    write_ctr(test, [data.test_set()], format, row_group)
    return paths, test
