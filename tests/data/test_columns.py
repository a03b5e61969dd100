"""Each kind of column as a model receives it: dense values filled and transformed, ids into their table's
rows (ints, hashed strings, hex, raw ids), list columns as nn.EmbeddingBag takes them, and shared tables."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from towerflow.data import Categorical, CategoricalList, Dense, FileStream, Schema, read_all
from towerflow.data.hashing import stable_hash
from towerflow.errors import DataError


def _parquet(tmp_path, name="part-0.parquet", **columns):
    path = tmp_path / name
    pq.write_table(pa.table({"y": pa.array([1] * len(next(iter(columns.values())))), **columns}), path)
    return str(path)


def _rows_of(values, rows):
    return (stable_hash(pa.array(values, pa.string())) % rows).tolist()


def test_dense_transforms_and_fill(tmp_path):
    p = pa.array([-3.0, 0.0, 1.0, None, 9.0])
    path = _parquet(tmp_path, a=p, b=p, c=p, d=p)
    schema = Schema("y", (Dense("a"), Dense("b", "log1p"), Dense("c", "standardize", mean=2.0, std=4.0),
                          Dense("d", fill=7.0)))
    batch = read_all(path, schema=schema)
    assert batch["a"].tolist() == [-3.0, 0.0, 1.0, 0.0, 9.0]  # missing: fill 0
    assert batch["b"].tolist() == pytest.approx([0.0, 0.0, math.log(2), 0.0, math.log(10)])  # negative clipped at 0
    assert batch["c"].tolist() == pytest.approx([-1.25, -0.5, -0.25, -0.5, 1.75])  # the fill, then standardized
    assert batch["d"].tolist() == [-3.0, 0.0, 1.0, 7.0, 9.0]
    assert batch.dense.dtype == torch.float32 and batch.dense.shape == (5, 4)


def test_a_stream_fits_standardize_from_the_first_records_of_the_files_in_sorted_order(tmp_path):
    rng = np.random.default_rng(3)
    first, second = rng.normal(5.0, 3.0, 60_000), rng.normal(-50.0, 1.0, 60_000)
    _parquet(tmp_path, "part-1.parquet", x=pa.array(second))  # written first; read second
    _parquet(tmp_path, "part-0.parquet", x=pa.array(first))
    schema = Schema("y", (Dense("x", "standardize"),))
    sample = np.concatenate([first, second[:40_000]]).astype(np.float32).astype(np.float64)  # FIT_SAMPLE records
    for worker in (0, 1):  # every worker fits the same numbers
        stream = FileStream(str(tmp_path), batch_size=4, schema=schema, worker=worker, num_workers=2)
        fitted = stream.schema.dense[0]
        assert fitted.mean == pytest.approx(sample.mean(), rel=1e-9)
        assert fitted.std == pytest.approx(sample.std(), rel=1e-9)
    batch = next(iter(FileStream(str(tmp_path), batch_size=4, schema=schema)))
    assert batch["x"].numpy() == pytest.approx((first[:4] - sample.mean()) / sample.std(), rel=1e-5)
    with pytest.raises(DataError, match="standardized columns whose mean and std are not fitted"):
        read_all(str(tmp_path), schema=schema)
    assert len(read_all(str(tmp_path), schema=stream.schema)) == 120_000  # the held-out set read by the fitted one


def test_int_ids_go_into_their_rows_negative_ones_too(tmp_path):
    path = _parquet(tmp_path, u=pa.array([-1, 0, 7, 12, None, -12]))
    assert read_all(path, schema=Schema("y", (Categorical("u", 5),)))["u"].tolist() == [4, 0, 2, 2, 0, 3]
    (tmp_path / "t.csv").write_text("y,u\n1,-1\n1, 7 \n1,\n1,-12\n")  # text: blanks around a number are ignored
    assert read_all(str(tmp_path / "t.csv"), schema=Schema("y", (Categorical("u", 5),)))["u"].tolist() == [4, 2, 0, 3]


def test_string_ids_are_hashed_into_rows_and_an_int_column_hashes_as_its_text(tmp_path):
    words = ["apple", "pear", "apple", None, "12"]
    path = _parquet(tmp_path, s=pa.array(words), n=pa.array([12, 3, 12, None, 7]))
    batch = read_all(path, schema=Schema("y", (Categorical("s", 1000, "string"), Categorical("n", 1000, "string"))))
    expected = _rows_of(["apple", "pear", "apple", "", "12"], 1000)
    assert batch["s"].tolist() == expected[:3] + [0] + expected[4:]  # missing: row 0, as for every kind
    assert batch["s"][0] == batch["s"][2] != batch["s"][1]
    assert batch["n"][0] == batch["s"][4]  # 12 in an int column and '12' in text: one row
    (tmp_path / "t.csv").write_text("y,s\n1,apple\n1,pear\n")
    csv = read_all(str(tmp_path / "t.csv"), schema=Schema("y", (Categorical("s", 1000, "string"),)))
    assert csv["s"].tolist() == batch["s"][:2].tolist()  # the same value, the same row, in any format


def test_hex_ids_and_raw_ids_without_rows(tmp_path):
    (tmp_path / "t.csv").write_text("y,h,s,n\n1,0a,apple,-5\n1,FF,pear,12345678901\n1,,,\n")
    schema = Schema("y", (Categorical("h", 7, "hex"), Categorical("s", None, "string"), Categorical("n")))
    batch = read_all(str(tmp_path / "t.csv"), schema=schema)
    assert batch["h"].tolist() == [10 % 7, 255 % 7, 0]
    raw = stable_hash(pa.array(["apple", "pear"])).tolist() + [0]  # a missing value: 0
    assert batch["s"].tolist() == raw and max(raw) > 2 ** 32  # the full 63-bit hash, for a hash table
    assert batch["n"].tolist() == [-5, 12345678901, 0]  # ints as they are
    assert schema.tables == {"h": 7, "s": None, "n": None}


def test_parquet_list_columns_of_ints_and_strings(tmp_path):
    path = _parquet(tmp_path, ints=pa.array([[1, 2, 13], [], None, [-1]], pa.list_(pa.int64())),
                    words=pa.array([["a"], ["b", "a"], None, []], pa.list_(pa.string())))
    schema = Schema("y", (CategoricalList("ints", 5), CategoricalList("words", 100, "string")))
    batch = read_all(path, schema=schema)
    ids, offsets = batch["ints"]
    assert ids.tolist() == [1, 2, 3, 4] and offsets.tolist() == [0, 3, 3, 3]  # missing or empty: an empty bag
    ids, offsets = batch["words"]
    assert ids.tolist() == _rows_of(["a", "b", "a"], 100) and offsets.tolist() == [0, 1, 3, 3]


def test_delimited_text_lists(tmp_path):
    (tmp_path / "t.csv").write_text("y,tags\n1,a|b|c\n1,\n1,a||b\n1,c|\n1,b\n")
    batch = read_all(str(tmp_path / "t.csv"), schema=Schema("y", (CategoricalList("tags", 100, "string"),)))
    ids, offsets = batch["tags"]
    assert offsets.tolist() == [0, 3, 3, 5, 6]  # '' an empty bag; 'a||b' two ids; 'c|' one
    assert ids.tolist() == _rows_of(["a", "b", "c", "a", "b", "c", "b"], 100)


def test_an_embedding_bag_over_a_list_column_sums_each_records_ids(tmp_path):
    (tmp_path / "t.tsv").write_text("y\ttags\n1\t3,1,4\n0\t\n1\t1,5,9,2\n0\t6\n")
    schema = Schema("y", (CategoricalList("tags", 8, delimiter=","),))
    batch = read_all(str(tmp_path / "t.tsv"), schema=schema)
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(8, 3, mode="sum")
    pooled = bag(*batch["tags"])
    w = bag.weight.detach()
    by_hand = torch.stack([w[[3, 1, 4]].sum(0), torch.zeros(3), w[[1, 5, 1, 2]].sum(0), w[6]])  # 9 mod 8 = 1
    assert torch.allclose(pooled, by_hand)


def test_columns_naming_one_table_share_its_rows(tmp_path):
    (tmp_path / "t.csv").write_text("y,item,history\n1,i7,i3|i7\n0,i3,\n")
    schema = Schema("y", (Categorical("item", 50, "string", table="items"),
                          CategoricalList("history", kind="string", table="items")))
    assert schema.tables == {"items": 50}  # a column may leave the rows to another
    batch = read_all(str(tmp_path / "t.csv"), schema=schema)
    ids, offsets = batch["history"]
    assert ids.tolist() == [batch["item"][1], batch["item"][0]]  # one value, one row, in both columns
    assert batch.names.tables == {"item": "items", "history": "items"}
    with pytest.raises(DataError, match=r"table 'items' is given 50 rows and 60 rows"):
        Schema("y", (Categorical("item", 50, "string", table="items"),
                     CategoricalList("history", 60, "string", table="items")))


def test_blank_fields_nulls_in_lists_and_spaces_around_listed_ids_read_as_pandas_would(tmp_path):
    (tmp_path / "t.csv").write_text("y,d,l\n1,  ,a | b\n0,2,\n1,,c||\n")
    schema = Schema("y", (Dense("d", fill=-1.0), CategoricalList("l", 100, "string")))
    batch = read_all(str(tmp_path / "t.csv"), schema=schema)
    assert batch["d"].tolist() == [-1.0, 2.0, -1.0]  # a blank field is missing: the fill
    ids, offsets = batch["l"]
    assert offsets.tolist() == [0, 2, 2] and ids.tolist() == _rows_of(["a", "b", "c"], 100)  # trimmed, no empty ids
    path = _parquet(tmp_path, y=pa.array([1, 0]), m=pa.array([[1, None, 2], [None]], pa.list_(pa.int64())))
    ids, offsets = read_all(path, schema=Schema("y", (CategoricalList("m", 100),)))["m"]
    assert ids.tolist() == [1, 2] and offsets.tolist() == [0, 2]  # a null inside a list is no id, as in text
