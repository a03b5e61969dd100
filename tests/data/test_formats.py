"""The same records read alike from every format a schema reads: Parquet, Arrow IPC, CSV with a header,
CSV and TSV without one (the schema names the fields), and gzip'd text, with or without a .gz name."""

from __future__ import annotations

import gzip

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from towerflow.data import Categorical, Dense, Schema, TextLayout, read_all
from towerflow.data.file_stream import FileStream
from towerflow.data.hashing import stable_hash

LABELS = [1, 0, 1, 0, 1, 0]
PRICE = [1.5, -2.0, None, 4.0, 0.0, 10.0]
USER = [5, -3, 12, None, 7, 100]
SITE = ["1fbe01fe", "ff", "x y", None, "1fbe01fe", "85f751fd"]
NAMES = ("click", "price", "user", "site")
COLUMNS = (Dense("price", fill=-1.0), Categorical("user", 10), Categorical("site", 50, "string"))


def _table():
    return pa.table({"click": pa.array(LABELS, pa.int8()), "price": pa.array(PRICE), "user": pa.array(USER),
                     "site": pa.array(SITE)})


def _lines(sep, header):
    cell = lambda v: "" if v is None else str(v)  # noqa: E731
    rows = [sep.join(cell(v) for v in record) for record in zip(LABELS, PRICE, USER, SITE)]
    return "\n".join(([sep.join(NAMES)] if header else []) + rows) + "\n"


def _write(tmp_path, kind):
    """A file of the records in `kind`, and the schema that reads it."""
    named = Schema("click", COLUMNS)
    headerless = Schema("click", COLUMNS, TextLayout(names=NAMES))
    if kind == "parquet":
        path = tmp_path / "part-0.parquet"
        pq.write_table(_table(), path, row_group_size=4)
        return path, named
    if kind == "arrow":
        path = tmp_path / "part-0.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, _table().schema) as writer:
            for batch in _table().to_batches(max_chunksize=4):
                writer.write_batch(batch)
        return path, named
    name, sep, header, zipped = {
        "csv": ("train.csv", ",", True, False),
        "csv-no-header": ("train.csv", ",", False, False),
        "tsv-no-header": ("train.tsv", "\t", False, False),
        "csv.gz": ("train.csv.gz", ",", True, True),
        "tsv.gz": ("train.tsv.gz", "\t", False, True),
        "gzip-without-gz-name": ("train.csv", ",", True, True),
    }[kind]
    path = tmp_path / name
    text = _lines(sep, header).encode()
    path.write_bytes(gzip.compress(text) if zipped else text)
    return path, named if header else headerless


KINDS = ["parquet", "arrow", "csv", "csv-no-header", "tsv-no-header", "csv.gz", "tsv.gz", "gzip-without-gz-name"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_gives_the_same_records(tmp_path, kind):
    path, schema = _write(tmp_path, kind)
    batch = read_all(str(path), schema=schema)
    assert batch.labels.tolist() == LABELS
    assert batch["price"].tolist() == [1.5, -2.0, -1.0, 4.0, 0.0, 10.0]  # missing: the fill
    assert batch["user"].tolist() == [5, 7, 2, 0, 7, 0]  # mod 10 rows, -3 too; missing: row 0
    site = [0 if v is None else r for v, r in zip(SITE, (stable_hash(pa.array(SITE)) % 50).tolist())]  # missing: 0
    assert batch["site"].tolist() == site and site[0] == site[4]  # a value's row is the same on every record


@pytest.mark.parametrize("kind", ["csv-no-header", "tsv.gz", "gzip-without-gz-name"])
def test_a_stream_of_text_batches_covers_the_file_in_order(tmp_path, kind):
    path, schema = _write(tmp_path, kind)
    stream = FileStream(str(path), batch_size=4, schema=schema)
    it = iter(stream)
    first, second = next(it), next(it)
    assert (len(first), len(second)) == (4, 2)  # an epoch's last batch is short
    assert first.labels.tolist() + second.labels.tolist() == LABELS
    assert np.allclose(second["price"].numpy(), [0.0, 10.0])
