"""Embedding rows as Parquet files of `(id, vector[, version])`: what an export and a delta hand a serving store.

One schema for every writer and reader: `id` int64, `vector` a fixed-size list of float32 (a serving store
reads float32; bfloat16 and float16 rows are widened), and, in deltas, `version` int64. A file is written
in row groups of `chunk_rows`, from an iterator of chunks, so a caller never holds a whole table; each file
goes through `atomic_write`, so a reader sees it whole or not at all. pyarrow is imported on first use
(the `files` extra).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Tuple

import torch

from towerflow._io import atomic_write
from towerflow.errors import ParameterServerError

CHUNK_ROWS = 65536  # rows per Parquet row group: ~4 MB of 16-wide float32 vectors

Chunk = Tuple[torch.Tensor, torch.Tensor]  # (ids [n] int64, values [n, dim])


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - the files extra is missing
        raise ParameterServerError("writing embedding rows as Parquet needs pyarrow: pip install 'towerflow[files]'") from None
    return pa, pq


def schema(dim: int, versioned: bool = False):
    """The rows' Arrow schema: id, vector (dim float32), and version for deltas."""
    pa, _ = _pyarrow()
    fields = [pa.field("id", pa.int64(), nullable=False), pa.field("vector", pa.list_(pa.float32(), dim), nullable=False)]
    if versioned:
        fields.append(pa.field("version", pa.int64(), nullable=False))
    return pa.schema(fields)


def to_arrow(ids: torch.Tensor, values: torch.Tensor, version: Optional[int] = None):
    """One record batch of rows (copies only where the dtype must change)."""
    pa, _ = _pyarrow()
    if values.dim() != 2 or ids.dim() != 1 or ids.numel() != values.shape[0]:
        raise ParameterServerError(f"rows: {ids.numel()} ids for values of shape {tuple(values.shape)}; expected one "
                                   "row [dim] per id")
    dim = values.shape[1]
    flat = values.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy()
    columns = [pa.array(ids.detach().to("cpu", torch.int64).numpy()), pa.FixedSizeListArray.from_arrays(flat, dim)]
    if version is not None:
        columns.append(pa.array([int(version)] * ids.numel(), type=pa.int64()))
    return pa.RecordBatch.from_arrays(columns, schema=schema(dim, version is not None))


def write_rows(path: str, dim: int, chunks: Iterable[Chunk], version: Optional[int] = None) -> int:
    """Write the rows of `chunks` to one Parquet file, atomically; returns how many rows it holds."""
    _, pq = _pyarrow()
    written = 0
    with atomic_write(path) as f:
        # no dictionary: ids are unique and vectors near-random, so it only costs (3x the write time, measured)
        with pq.ParquetWriter(f, schema(dim, version is not None), use_dictionary=False) as writer:
            for ids, values in chunks:
                if ids.numel():
                    writer.write_batch(to_arrow(ids, values, version))
                    written += ids.numel()
    return written


def chunked(ids: torch.Tensor, values: torch.Tensor, chunk_rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
    """(ids, values) cut into row groups (views: a memory-mapped shard is read a chunk at a time)."""
    for start in range(0, ids.numel(), chunk_rows):
        yield ids[start:start + chunk_rows], values[start:start + chunk_rows]


def write_ids(path: str, ids: torch.Tensor) -> int:
    """Ids alone, as Parquet `(id int64)` (a delta's evicted hash rows), atomically; returns how many."""
    pa, pq = _pyarrow()
    table = pa.table({"id": pa.array(ids.detach().to("cpu", torch.int64).numpy())},
                     schema=pa.schema([pa.field("id", pa.int64(), nullable=False)]))
    with atomic_write(path) as f:
        pq.write_table(table, f)
    return ids.numel()


def read_ids(path: str) -> torch.Tensor:
    """The ids of a file `write_ids` wrote."""
    _, pq = _pyarrow()
    return torch.from_numpy(pq.read_table(path).column("id").to_numpy().copy())


def read_rows(path: str) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(ids int64, values float32 [n, dim], versions int64 or None) of one rows file."""
    _, pq = _pyarrow()
    table = pq.read_table(path)
    dim = table.schema.field("vector").type.list_size
    ids = torch.from_numpy(table.column("id").to_numpy().copy())
    flat = table.column("vector").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    values = torch.from_numpy(flat.copy()).reshape(-1, dim)
    versions = (torch.from_numpy(table.column("version").to_numpy().copy())
                if "version" in table.schema.names else None)
    return ids, values, versions
