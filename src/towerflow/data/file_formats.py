"""Reading and writing click-log files through pyarrow: Parquet, Arrow IPC and Criteo's TSV.

Criteo's format: one record per line, tab-separated, no header: the label, 13 integer features
(I1..I13, counts, possibly empty) and 26 categorical ones (C1..C26, 8 hex digits of a hashed value,
possibly empty). Read as Criteo's users do: the integers as log(1 + max(x, 0)) with a missing value
as 0, each categorical hashed into its table's rows (its hex value modulo the rows; empty: row 0).
Parquet and Arrow files hold the same columns with float dense and integer id columns when
towerflow writes them, read as they are. No parser of ours: pyarrow's CSV reader reads the text.
"""

from __future__ import annotations

import os
from typing import Iterator, List, Sequence, Tuple

import numpy as np
import torch

from towerflow.errors import DataError

NUM_DENSE, NUM_CATS = 13, 26
LABEL = "label"
DENSE = [f"I{i}" for i in range(1, NUM_DENSE + 1)]
CATS = [f"C{i}" for i in range(1, NUM_CATS + 1)]
COLUMNS = [LABEL, *DENSE, *CATS]
TEXT_BLOCK = 1 << 20  # bytes of text per parsed block: bounds a text reader's memory
_HEX = np.full(256, -1, dtype=np.int64)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def pyarrow():
    """pyarrow, or an error that says how to get it."""
    try:
        import pyarrow as pa
        import pyarrow.csv  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("reading data files needs pyarrow: pip install 'towerflow[files]' (or pip install pyarrow)") from None
    return pa


def part_sizes(path: str, fmt: str) -> List[int]:
    """Records per row group (Parquet) or record batch (Arrow IPC) of a file."""
    pa = pyarrow()
    try:
        if fmt == "parquet":
            meta = pa.parquet.ParquetFile(path).metadata
            return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        with pa.memory_map(path) as source:
            reader = pa.ipc.open_file(source)
            return [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable {fmt} file ({str(e).splitlines()[0]})") from None


def read_part(path: str, part: int, fmt: str, skip: int = 0, on_bad_record: str = "error") -> Iterator[Tuple[object, int]]:
    """The record batches of one unit from record `skip` on, each with the bad records skipped before it."""
    pa = pyarrow()
    if fmt == "parquet":
        table = pa.parquet.ParquetFile(path).read_row_group(part)
        yield from ((b, 0) for b in table.slice(skip).to_batches())
    elif fmt == "arrow":
        with pa.memory_map(path) as source:
            yield pa.ipc.open_file(source).get_batch(part).slice(skip), 0
    else:
        yield from _read_criteo(path, skip, on_bad_record)


def _read_criteo(path: str, skip: int, on_bad_record: str) -> Iterator[Tuple[object, int]]:
    pa = pyarrow()
    bad: List[int] = []
    refused: List[object] = []

    def handler(row) -> str:  # an exception raised here would not reach the caller: pyarrow reports its own
        if on_bad_record == "skip":
            bad.append(1)
            return "skip"
        refused.append(row)
        return "error"

    types = {LABEL: pa.int8(), **{c: pa.float64() for c in DENSE}, **{c: pa.string() for c in CATS}}
    try:
        reader = pa.csv.open_csv(
            path, read_options=pa.csv.ReadOptions(column_names=COLUMNS, block_size=TEXT_BLOCK, use_threads=False),
            parse_options=pa.csv.ParseOptions(delimiter="\t", quote_char=False, invalid_row_handler=handler),
            convert_options=pa.csv.ConvertOptions(column_types=types, strings_can_be_null=True,
                                                  null_values=[""], quoted_strings_can_be_null=False))
        for batch in reader:
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            taken, bad[:] = len(bad), []
            yield batch.slice(skip), taken
            skip = 0
    except pa.ArrowInvalid as e:
        if refused:
            row = refused[0]
            line = f"line {row.number}" if row.number is not None else "a line"
            raise DataError(f"{path}, {line}: {row.actual_columns} columns, expected {row.expected_columns} (a label, "
                            f"13 integers, 26 categoricals, tab-separated): {row.text[:120]!r}; pass "
                            "on_bad_record='skip' to count and skip such lines") from None
        raise DataError(f"{path}: {str(e).splitlines()[0]} (expected a Criteo line: an integer label, 13 integers, "
                        "26 hex categoricals, tab-separated)") from None


def to_tensors(batch, rows_per_table: Sequence[int], path: str = "") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dense float32 [B, 13], cats int64 [B, 26], labels float32 [B]) of a record batch of these columns."""
    pa = pyarrow()
    names = batch.schema.names
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise DataError(f"{path or 'a record batch'} lacks the columns {missing[:5]}{'...' if len(missing) > 5 else ''}: "
                        f"expected {LABEL}, I1..I13, C1..C26")
    labels = torch.from_numpy(batch.column(LABEL).to_numpy(zero_copy_only=False).astype(np.float32))
    dense = np.empty((batch.num_rows, NUM_DENSE), dtype=np.float32)
    as_written = batch.schema.metadata is not None and b"towerflow" in batch.schema.metadata  # our floats, not counts
    for j, name in enumerate(DENSE):
        col = batch.column(name)
        if as_written:
            dense[:, j] = col.to_numpy(zero_copy_only=False)
        else:  # Criteo's counts
            values = col.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64)
            dense[:, j] = np.log1p(np.maximum(values, 0.0))
    cats = np.empty((batch.num_rows, NUM_CATS), dtype=np.int64)
    for j, name in enumerate(CATS):
        col = batch.column(name)
        ids = col.to_numpy(zero_copy_only=False) if pa.types.is_integer(col.type) else _hex_ids(col, name, path)
        cats[:, j] = ids % rows_per_table[j]
    return torch.from_numpy(dense), torch.from_numpy(cats), labels


def _hex_ids(col, name: str, path: str) -> np.ndarray:
    """Hex strings -> integers, vectorized; an empty or missing value is 0, a non-hex digit is named."""
    col = col.fill_null("")
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int32)[col.offset:col.offset + len(col) + 1]
    data = np.frombuffer(col.buffers()[2], dtype=np.uint8) if col.buffers()[2] is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    if lengths.size and lengths.max() > 15:
        row = int(np.argmax(lengths > 15))
        raise DataError(f"{path}, column {name}, record {row}: {col[row].as_py()[:40]!r} is longer than 15 hex digits")
    out = np.zeros(len(col), dtype=np.int64)
    for k in range(int(lengths.max()) if lengths.size else 0):
        has = lengths > k
        digit = _HEX[data[offsets[:-1][has] + k]]
        if (digit < 0).any():
            row = int(np.flatnonzero(has)[np.argmax(digit < 0)])
            raise DataError(f"{path}, column {name}, record {row}: {col[row].as_py()!r} is not a hex number "
                            "(Criteo's categoricals are hashed values in hex)")
        out[has] = out[has] * 16 + digit
    return out


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
        arrays = [pa.array(labels.astype(np.int8))] + [pa.array(counts[:, j]) for j in range(NUM_DENSE)] + \
                 [pa.array(np.char.mod("%08x", cats[:, j])) for j in range(NUM_CATS)]
        pa.csv.write_csv(pa.Table.from_arrays(arrays, names=COLUMNS), tmp, write_options=pa.csv.WriteOptions(
            include_header=False, delimiter="\t", quoting_style="none"))
    else:
        arrays = [pa.array(labels.astype(np.int8))] + [pa.array(dense[:, j]) for j in range(NUM_DENSE)] + \
                 [pa.array(cats[:, j]) for j in range(NUM_CATS)]
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
