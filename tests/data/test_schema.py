"""A schema inferred from a file's columns, written to a JSON or YAML file and read back equal, and a wrong
one refused with the key or value at fault named."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from towerflow.data import Categorical, CategoricalList, Dense, Schema, TextLayout, read_all
from towerflow.errors import DataError

AVAZU = ("click,hour,C1,banner_pos,site_id,site_category,device_ip\n"
         "0,14102100,1005,0,1fbe01fe,f028772b,ddd2926e\n"
         "1,14102100,1005,1,85f751fd,50e219e0,96809ac8\n"
         "0,14102101,1002,0,1fbe01fe,28905ebd,b3cf8def\n")


@pytest.fixture
def warehouse(tmp_path):
    """Parquet as a warehouse exports it: a label, int ids, text ids, floats, counts and lists."""
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({
        "clk": pa.array([1, 0], pa.int8()), "userid": pa.array(["u1", "u2"]), "adgroup_id": pa.array([3, 4]),
        "price": pa.array([1.5, 2.5]), "visits": pa.array([3, 0]), "note": pa.array(["x", "y"]),
        "hist": pa.array([[1, 2], []], pa.list_(pa.int64())), "tags": pa.array([["a"], ["b", "c"]]),
    }), path)
    return str(path)


def test_infer_reads_a_parquet_files_columns_by_their_types(warehouse):
    schema = Schema.infer(warehouse, label="clk", rows={"userid": 100}, dense=["visits"], exclude=["note"])
    assert schema == Schema("clk", (
        Categorical("userid", 100, "string"), Categorical("adgroup_id", 1_000_000, "int"), Dense("price"),
        Dense("visits"), CategoricalList("hist", 1_000_000, "int"), CategoricalList("tags", 1_000_000, "string")))
    batch = read_all(warehouse, schema=schema)
    assert batch["visits"].tolist() == [3.0, 0.0] and batch["adgroup_id"].tolist() == [3, 4]


def test_infer_names_a_missing_label_and_unknown_columns(warehouse):
    with pytest.raises(DataError, match=r"has no column 'click' for the label; its columns are \['clk', 'userid'"):
        Schema.infer(warehouse, label="click")
    with pytest.raises(DataError, match=r"has no columns \['nope'\]"):
        Schema.infer(warehouse, label="clk", exclude=["nope"])


def test_infer_reads_an_avazu_csv_header_with_hex_like_ids_as_text(tmp_path):
    (tmp_path / "train.csv").write_text(AVAZU)
    schema = Schema.infer(str(tmp_path / "train.csv"), label="click", rows=1000, exclude=["device_ip"])
    assert schema == Schema("click", (Categorical("hour", 1000), Categorical("C1", 1000),
                                      Categorical("banner_pos", 1000), Categorical("site_id", 1000, "string"),
                                      Categorical("site_category", 1000, "string")))
    assert schema.text.has_header
    batch = read_all(str(tmp_path / "train.csv"), schema=schema)
    assert batch.labels.tolist() == [0.0, 1.0, 0.0]
    assert batch["C1"].tolist() == [5, 5, 2] and batch["site_id"][0] == batch["site_id"][2] != batch["site_id"][1]


def test_infer_a_headerless_tsv_by_the_names_given(tmp_path):
    (tmp_path / "day_0.tsv").write_text("1\t0.5\tab\n0\t1.5\tcd\n")
    schema = Schema.infer(str(tmp_path / "day_0.tsv"), label="y", rows=10, names=["y", "x", "s"])
    assert schema == Schema("y", (Dense("x"), Categorical("s", 10, "string")), TextLayout(None, False, ("y", "x", "s")))
    assert read_all(str(tmp_path / "day_0.tsv"), schema=schema)["x"].tolist() == [0.5, 1.5]


EVERYTHING = Schema("clk", (
    Dense("price", "standardize", fill=-1.0, mean=2.0, std=0.5), Dense("visits", "log1p"),
    Categorical("userid", 100, "string", table="users"), Categorical("seller", 50, "hex"), Categorical("raw"),
    CategoricalList("history", None, "string", table="users", delimiter=";"), CategoricalList("tags", 20)),
    TextLayout(",", False, ("clk", "price", "visits", "userid", "seller", "raw", "history", "tags")))


@pytest.mark.parametrize("name", ["schema.json", "schema.yaml", "schema.yml"])
def test_a_schema_file_round_trips(tmp_path, name):
    if name != "schema.json":
        pytest.importorskip("yaml")
    for schema in (EVERYTHING, Schema.criteo(list(range(1, 27))), Schema("y", ())):
        path = schema.save(str(tmp_path / name))
        assert Schema.load(path) == schema
    assert Schema.from_dict(EVERYTHING.to_dict()) == EVERYTHING


def test_a_hand_written_json_schema_reads_short_forms(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({
        "label": "clk", "dense": ["price", {"name": "visits", "transform": "log1p"}],
        "categorical": [{"name": "userid", "rows": 100, "kind": "string"}], "lists": [{"name": "tags", "rows": 9}]}))
    assert Schema.load(str(tmp_path / "s.json")) == Schema("clk", (
        Dense("price"), Dense("visits", "log1p"), Categorical("userid", 100, "string"), CategoricalList("tags", 9)))


@pytest.mark.parametrize("spec,message", [
    ({"label": "y", "dense": ["x"], "categorcal": []}, r"unknown keys \['categorcal'\]"),
    ({"label": "y", "dense": [{"name": "x", "transfrom": "log1p"}]}, r"dense entry .*'transfrom'"),
    ({"label": "y", "dense": [{"name": "x", "transform": "log"}]}, r"dense column 'x': transform='log', expected one"),
    ({"label": "y", "categorical": [{"name": "c", "kind": "hash"}]}, r"column 'c': kind='hash'"),
    ({"label": "y", "categorical": [{"name": "c", "rows": 0}]}, r"column 'c': rows=0"),
    ({"label": "y", "text": {"delimeter": ","}}, r"text .*'delimeter'"),
    ({"dense": ["x"]}, r"no 'label'"),
    ({"label": "y", "dense": ["y"]}, r"the label 'y' is also declared as a feature"),
    ({"label": "y", "dense": ["x", "x"]}, r"names the columns \['x'\] more than once"),
    ({"label": "y", "dense": ["x"], "text": {"names": ["y"]}}, r"lack the schema's columns \['x'\]"),
])
def test_a_wrong_schema_file_is_named_with_the_key_at_fault(tmp_path, spec, message):
    (tmp_path / "s.json").write_text(json.dumps(spec))
    with pytest.raises(DataError, match=message):
        Schema.load(str(tmp_path / "s.json"))


def test_a_schema_file_that_is_not_json_is_named_by_line(tmp_path):
    (tmp_path / "s.json").write_text('{"label": "y",\n "dense": [x]}')
    with pytest.raises(DataError, match=r"s.json, line 2, column 12: not valid JSON"):
        Schema.load(str(tmp_path / "s.json"))


def test_a_text_column_of_booleans_is_inferred_dense_and_read_as_one_and_zero(tmp_path):
    (tmp_path / "t.csv").write_text("y,is_app,s\n1,true,a\n0,False,b\n1,,c\n")
    schema = Schema.infer(str(tmp_path / "t.csv"), label="y", rows=10)
    assert schema.columns[0] == Dense("is_app")
    assert read_all(str(tmp_path / "t.csv"), schema=schema)["is_app"].tolist() == [1.0, 0.0, 0.0]
    (tmp_path / "t.csv").write_text("y,is_app,s\n1,true,a\n0,maybe,b\n")
    with pytest.raises(DataError, match=r"t.csv, line 3, column 'is_app': 'maybe' is not a number"):
        read_all(str(tmp_path / "t.csv"), schema=schema)
