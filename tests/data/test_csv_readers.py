"""A text file read only in part must not crash the process at exit: pyarrow's threads parse ahead and drop our
row handler late, which aborts the interpreter once it finalizes. The exit waits until pyarrow let go of it;
tests/data/test_hashing.py runs the processes that stop a FileStream midway and exit."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.csv  # noqa: F401

from towerflow.data import csv_readers


def _write(path, lines: int) -> str:
    path.write_text("".join(f"{i % 2},w{i}\n" if i % 7 else f"{i % 2}\n" for i in range(lines)))  # short lines too
    return str(path)


def test_pyarrow_lets_go_of_the_row_handler_of_a_reader_closed_midway(tmp_path):
    path = _write(tmp_path / "t.csv", 200_000)
    with csv_readers.csv_reader(pa.input_stream(path), pa.csv.ReadOptions(block_size=1 << 14, use_threads=False,
                                                                           column_names=["y", "s"]),
                                ",", lambda row: "skip") as reader:
        reader.read_next_batch()
    del reader
    csv_readers._settle()
    assert [h for h in csv_readers._closed if h() is not None] == []

