"""A value that does not fit its column is named by file, line (text, the header is line 1) or row (Parquet,
from 0) and column; with on_bad_record='skip' its record is dropped and counted."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from towerflow.data import Categorical, CategoricalList, Dense, FileStream, Schema, read_all
from towerflow.errors import DataError

SCHEMA = Schema("click", (Dense("price"), Categorical("user", 10), CategoricalList("tags", 10)))
GOOD = ["1,2.5,3,1|2", "0,4,5,", "1,,7,3"]


def _csv(tmp_path, bad_line):
    path = tmp_path / "train.csv"
    path.write_text("\n".join(["click,price,user,tags", *GOOD[:2], bad_line, GOOD[2]]) + "\n")
    return str(path)


@pytest.mark.parametrize("bad_line,message", [
    ("1,cheap,3,1", r"train.csv, line 4, column 'price': 'cheap' is not a number"),
    ("1,2,u3,1", r"train.csv, line 4, column 'user': 'u3' is not an integer id"),
    ("1,2,3.5,1", r"train.csv, line 4, column 'user': '3.5' is not an integer id"),
    (",2,3,1", r"train.csv, line 4, column 'click': a missing value is not a label"),
    ("1,2,3,1|x", r"train.csv, line 4, column 'tags': 'x' is not an int id \(in a list\)"),
    ("1,2,3,1,9", r"train.csv, line 4: 5 fields, expected 4"),
])
def test_a_bad_value_is_named_then_skipped_and_counted(tmp_path, bad_line, message):
    path = _csv(tmp_path, bad_line)
    with pytest.raises(DataError, match=message):
        read_all(path, schema=SCHEMA)
    stream = FileStream(path, batch_size=10, schema=SCHEMA, on_bad_record="skip")
    batch = next(iter(stream))
    assert batch.labels.tolist() == [1.0, 0.0, 1.0] and batch["user"].tolist() == [3, 5, 7]
    ids, offsets = batch["tags"]
    assert ids.tolist() == [1, 2, 3] and offsets.tolist() == [0, 2, 2]  # the bags stay with their records
    assert stream.bad_records == 1


def test_every_bad_record_of_a_file_is_counted(tmp_path):
    lines = ["click,price,user,tags", "1,cheap,3,1", GOOD[0], "1,2,u3,1", ",2,3,1", GOOD[1], "1,2,3,1,9", GOOD[2]]
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    stream = FileStream(str(tmp_path / "train.csv"), batch_size=10, schema=SCHEMA, on_bad_record="skip")
    batch = next(iter(stream))
    assert batch["user"].tolist() == [3, 5, 7] and stream.bad_records == 4


def test_a_parquet_bad_value_is_named_by_its_row(tmp_path):
    table = pa.table({"click": pa.array([1, 0, 1, None, 1, 1]),
                      "price": pa.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
                      "user": pa.array([1.0, 2.0, 3.0, 4.0, 5.5, 6.0])})  # ids stored as floats, one not whole
    pq.write_table(table, tmp_path / "part-0.parquet", row_group_size=2)
    schema = Schema("click", (Dense("price"), Categorical("user", 10)))
    with pytest.raises(DataError, match=r"part-0.parquet, row 3, column 'click': a missing value is not a label"):
        read_all(str(tmp_path), schema=schema)
    stream = FileStream(str(tmp_path), batch_size=10, schema=schema, on_bad_record="skip")
    batch = next(iter(stream))
    assert batch["price"].tolist() == [1.0, 2.0, 3.0, 6.0] and stream.bad_records == 2
    pq.write_table(table.set_column(0, "click", pa.array([1] * 6)), tmp_path / "part-0.parquet", row_group_size=2)
    with pytest.raises(DataError, match=r"part-0.parquet, row 4, column 'user': 5.5 is not an integer id"):
        read_all(str(tmp_path), schema=schema)
