"""Reading data files through pyarrow: Parquet row groups, Arrow IPC record batches, delimited text.

A `Layout` says how a set of files is read: the format and the schema (`schema.py`), whose text layout
gives a text file's delimiter and field names. Reads come in `Chunk`s that know where each record came
from, so a bad value is named by file and line (text) or row (Parquet, Arrow). Files without a schema
are read in Criteo's layout; the Parquet and Arrow files towerflow writes (`ctr_files.py`) say so in their
metadata, and their float dense columns are read as they are.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from towerflow.data import columns, text_files
from towerflow.data.features import FeatureNames, Features
from towerflow.data.schema import Schema
from towerflow.errors import DataError

WRITTEN_BY_US = b"towerflow"  # the metadata key of the files ctr_files.py writes


def pyarrow():
    """pyarrow, or an error that says how to get it."""
    try:
        import pyarrow as pa
        import pyarrow.compute  # noqa: F401
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


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a set of files is read: the format (parquet, arrow, text) and the schema."""

    format: str
    schema: Schema

    def text_names(self, path: str) -> List[str]:
        """Every field of a text file's lines, in order: its header's names, or the schema's."""
        text = self.schema.text
        if text.has_header:
            return list(_header(path, text.delimiter_for(path)))
        return list(text.names)


@functools.lru_cache(maxsize=4096)
def _header(path: str, delimiter: str) -> Tuple[str, ...]:
    return tuple(text_files.header_names(path, delimiter))


@dataclasses.dataclass
class Chunk:
    """Records of one read, the bad records skipped before them, and where each came from."""

    batch: object
    bad: int
    path: str
    lines: Optional[np.ndarray] = None  # text: each record's line
    first_row: int = 0  # Parquet / Arrow: the first record's row in its file, from 0

    def locate(self, i: int) -> str:
        if self.lines is not None:
            return f"{self.path}, line {int(self.lines[i]) if len(self.lines) else '?'}"
        return f"{self.path}, row {self.first_row + i}"


def read_part(path: str, part: int, layout: Layout, skip: int = 0, on_bad_record: str = "error") -> Iterator[Chunk]:
    """The records of one unit from record `skip` on, in chunks."""
    pa = pyarrow()
    fmt = layout.format
    try:
        if fmt == "parquet":
            pf = pa.parquet.ParquetFile(path)
            first = sum(pf.metadata.row_group(i).num_rows for i in range(part)) + skip
            wanted = [c for c in layout.schema.needed if c in pf.schema_arrow.names]
            for batch in pf.read_row_group(part, columns=wanted).slice(skip).to_batches():
                yield Chunk(batch, 0, path, first_row=first)
                first += batch.num_rows
            return
        if fmt == "arrow":
            with pa.memory_map(path) as source:
                reader = pa.ipc.open_file(source)
                first = sum(reader.get_batch(i).num_rows for i in range(part)) + skip
                yield Chunk(reader.get_batch(part).slice(skip), 0, path, first_row=first)
            return
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable {fmt} file ({str(e).splitlines()[0]})") from None
    text = layout.schema.text
    names = layout.text_names(path)
    for batch, bad, lines in text_files.read_text(path, names, text.has_header, text.delimiter_for(path),
                                                  [c for c in layout.schema.needed if c in names], skip, on_bad_record):
        yield Chunk(batch, bad, path, lines=lines)


def to_features(chunk: Chunk, layout: Layout, names: FeatureNames, on_bad_record: str = "error") -> Tuple[Features, int]:
    """(Features, bad records skipped) of a chunk."""
    return columns.to_features(chunk.batch, layout.schema, names, chunk.locate, on_bad_record)


def layout_for(files: Sequence[str], fmt: str, schema: Optional[Schema],
               rows_per_table: Optional[Sequence[int]]) -> Layout:
    """The layout a stream reads: its schema, or Criteo's with `rows_per_table`."""
    fmt = "text" if fmt == "criteo" else fmt
    if schema is not None:
        if not isinstance(schema, Schema):
            raise DataError(f"schema={schema!r}: expected a towerflow.data.Schema (Schema.load(path) reads a file)")
        return Layout(fmt, schema)
    if rows_per_table is None:
        raise DataError("no schema and no rows_per_table: pass schema=Schema.infer(path, label=...) (or a Schema, or "
                        "Schema.load(file)) for your columns, or rows_per_table for Criteo's layout")
    written = fmt != "text" and WRITTEN_BY_US in (_metadata(files[0], fmt) or {})
    return Layout(fmt, Schema.criteo(list(rows_per_table), "none" if written else "log1p"))


def _metadata(path: str, fmt: str):
    pa = pyarrow()
    try:
        if fmt == "parquet":
            return pa.parquet.read_schema(path).metadata
        with pa.memory_map(path) as source:
            return pa.ipc.open_file(source).schema.metadata
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable {fmt} file ({str(e).splitlines()[0]})") from None
