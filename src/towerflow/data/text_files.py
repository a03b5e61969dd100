"""Delimited text files (CSV, TSV, Criteo's lines, gzip'd or not) read as pandas reads them, through pyarrow.

pyarrow's CSV reader does the parsing, block by block; every column is read as text and converted by
the schema (`columns.py`), so a value that does not parse is named with its line. Two things pandas
does and pyarrow's reader refuses are done here around it:
* a line with fewer fields than the file's columns (Criteo copies often strip trailing empty fields)
  has its missing fields read as missing: the reader hands such lines to a handler, which keeps them;
  they are padded with delimiters, parsed again by pyarrow, and put back in their place in the block;
* blank lines are skipped.
A line with more fields than the columns is a bad record: an error naming the file and line, or skipped
and counted with `on_bad_record="skip"`. Every record carries its line number.
"""

from __future__ import annotations

import io
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from towerflow.data.csv_readers import csv_reader
from towerflow.errors import DataError

TEXT_BLOCK = 1 << 20  # bytes of text per parsed block: bounds a text reader's memory
_GZIP_MAGIC = b"\x1f\x8b"

def open_text(path: str):
    """The file's bytes, decompressed when it is gzip'd (by its first bytes, whatever its name)."""
    import pyarrow as pa

    with open(path, "rb") as f:
        magic = f.read(2)
    return pa.input_stream(path, compression="gzip" if magic == _GZIP_MAGIC else None)


def header_names(path: str, delimiter: str) -> List[str]:
    """The column names of a text file's header line."""
    import pyarrow as pa
    import pyarrow.csv  # noqa: F401

    try:
        with csv_reader(open_text(path), pa.csv.ReadOptions(block_size=1 << 16, use_threads=False), delimiter,
                        lambda row: "skip") as reader:
            return list(reader.schema.names)
    except pa.ArrowInvalid as e:
        raise DataError(f"{path}: cannot read a header line ({str(e).splitlines()[0]})") from None


def read_text(path: str, names: Sequence[str], header: bool, delimiter: str, include: Sequence[str], skip: int = 0,
              on_bad_record: str = "error") -> Iterator[Tuple[object, int, np.ndarray]]:
    """(record batch of the `include` columns as strings, bad lines skipped before it, each record's line) from
    record `skip` on. `names` are every field of a line, in order; `include` the columns read, the label first."""
    import pyarrow as pa
    import pyarrow.csv  # noqa: F401

    expected = len(names)
    handled: List[Tuple[int, str, int]] = []  # (line, text, fields) of the lines the reader did not take

    def handler(row) -> str:  # keep it; an exception raised here would not reach the caller
        handled.append((row.number, row.text, row.actual_columns))
        return "skip"

    convert = pa.csv.ConvertOptions(column_types={n: pa.string() for n in include}, include_columns=list(include),
                                    strings_can_be_null=True)
    read = pa.csv.ReadOptions(column_names=list(names), skip_rows=1 if header else 0, block_size=TEXT_BLOCK,
                              use_threads=False)
    line = 2 if header else 1  # the line of the next block's first record

    def block(batch, last: bool):
        """The batch with the handled lines among its own (the reader parses ahead: some are the next block's)."""
        nonlocal line
        handled.sort()
        numbers = np.array([h[0] for h in handled], dtype=np.int64)
        end = line + batch.num_rows  # the line after the batch's last record: its records and the handled lines
        while True:  # before it fill the lines from `line` on
            nxt = line + batch.num_rows + int(np.searchsorted(numbers, end))
            if nxt == end:
                break
            end = nxt
        if batch.num_rows == 0:  # a block of short lines only: the run of them from `line` (all, at the end)
            run = numbers - line - np.arange(len(numbers))
            end = int(numbers[-1]) + 1 if last and len(numbers) else line + int(np.searchsorted(run, 1))
        mine = int(np.searchsorted(numbers, end))
        out = _mend(batch, handled[:mine], line, path, expected, names, delimiter, convert, on_bad_record)
        del handled[:mine]
        line = end
        return out

    try:
        with csv_reader(open_text(path), read, delimiter, handler, convert, ignore_empty_lines=False) as reader:
            batches = iter(reader)
            while True:
                batch = next(batches, None)
                last = batch is None
                if last:
                    if not handled:
                        break
                    batch = pa.RecordBatch.from_pylist([], schema=reader.schema)  # short lines after the last one
                batch, lines, bad = block(batch, last)
                batch, lines = _drop_blank(batch, lines, include[0] if include else None)
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    if bad:
                        yield batch.slice(0, 0), bad, lines[:0]
                    continue
                yield batch.slice(skip), bad, lines[skip:]
                skip = 0
    except pa.ArrowInvalid as e:
        raise DataError(f"{path}: {str(e).splitlines()[0]} (expected {expected} fields separated by "
                        f"{delimiter!r})") from None


def _mend(batch, handled, first_line: int, path: str, expected: int, names, sep: str, convert, on_bad_record):
    """The block's records with its short lines back in place (missing fields as missing); its too-long lines
    refused or counted. Returns (batch, each record's line, bad lines)."""
    import pyarrow as pa

    good = np.ones(batch.num_rows + len(handled), dtype=bool)
    short: List[Tuple[int, str]] = []
    bad = 0
    for number, text, fields in handled:
        good[number - first_line] = False
        if fields > expected:
            if on_bad_record != "skip":
                raise DataError(f"{path}, line {number}: {fields} fields, expected {expected} "
                                f"({', '.join(names[:4])}{', ...' if expected > 4 else ''}): {text[:120]!r}; pass "
                                "on_bad_record='skip' to count and skip such lines")
            bad += 1
        else:
            short.append((number, text))
    lines = np.flatnonzero(good) + first_line
    if not short:
        return batch, lines, bad
    padded = "\n".join(text + sep * (expected - 1 - text.count(sep)) for _, text in short).encode()
    mended = pa.csv.read_csv(io.BytesIO(padded), read_options=pa.csv.ReadOptions(column_names=list(names),
                                                                                  use_threads=False),
                             parse_options=pa.csv.ParseOptions(delimiter=sep), convert_options=convert)
    table = pa.concat_tables([pa.Table.from_batches([batch], batch.schema), mended.cast(batch.schema)])
    all_lines = np.concatenate([lines, np.array([n for n, _ in short], dtype=np.int64)])
    order = np.argsort(all_lines, kind="stable")
    merged = table.take(pa.array(order)).combine_chunks().to_batches()
    return (merged[0] if merged else batch.slice(0, 0)), all_lines[order], bad


def _drop_blank(batch, lines: np.ndarray, label: Optional[str]):
    """Without the blank lines (read as records whose every column is missing), as pandas skips them. Only the
    records missing their label are looked at: a blank line misses it too."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if label not in batch.schema.names or batch.num_rows == 0:
        return batch, lines
    candidates = np.flatnonzero(pc.is_null(batch.column(label)).to_numpy(zero_copy_only=False))
    if not candidates.size:
        return batch, lines
    rows = batch.take(pa.array(candidates))
    blank = np.ones(len(candidates), dtype=bool)
    for col in rows.columns:
        blank &= pc.is_null(col).to_numpy(zero_copy_only=False)
    if not blank.any():
        return batch, lines
    keep = np.setdiff1d(np.arange(batch.num_rows), candidates[blank])
    return batch.take(pa.array(keep)), lines[keep]
