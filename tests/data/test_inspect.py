"""`towerflow data inspect`: the files, the schema and the first records as the model sees them, and
errors said in one line."""

from __future__ import annotations

import json
import re

import pytest

from towerflow.cli import main
from towerflow.data import synthetic_ctr
from towerflow.data.ctr_files import write_ctr, write_named_ctr_files
from towerflow.data.schema import Schema

pytest.importorskip("pyarrow")


def _inspect(capsys, *args):
    code = main(["data", "inspect", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out):
    """The printed records: feature -> its values, one per record."""
    records = [re.split(r"\s{2,}", line.strip()) for line in out.split("as the model sees")[1].splitlines()[1:]
               if line.startswith("  ")]
    return {cells[0].replace(" (label)", ""): cells[1:] for cells in records}


def test_a_named_parquet_export_is_inferred_and_its_text_ids_shown_as_row_ids(tmp_path, capsys):
    data = synthetic_ctr(50, num_tables=4, num_dense=3, seed=0, test_size=10)
    paths, _ = write_named_ctr_files(data, str(tmp_path), files=2, records_per_file=30, row_group=10)
    code, out, err = _inspect(capsys, tmp_path / "train", "--label", "clk", "--rows", 50, "--head", 4)
    assert code == 0 and not err
    assert "files: 2 parquet files" in out and "60 records in 6 row groups" in out
    schema = {line.split()[0]: line.split()[1:] for line in out.split("schema:")[1].split("features:")[0].splitlines()[2:]}
    assert schema["clk"] == ["label"] and schema["f0"] == ["dense", "none"]
    assert schema["userid"] == ["categorical", "string,", "hashed", "userid", "50"]
    assert schema["adgroup_id"] == ["categorical", "int", "adgroup_id", "50"]
    assert schema["hist0"] == ["list", "int", "hist0", "50"]
    assert "text layout" not in out  # Parquet has none
    rows = _rows(out)
    assert len(rows["clk"]) == 4 and all(v in ("0", "1") for v in rows["clk"])
    assert all(0 <= int(v) < 50 for v in rows["userid"])  # `u123` hashed into the table's 50 rows
    first = Schema.infer(paths[0], label="clk", rows=50)
    from towerflow.data.file_stream import read_all

    whole = read_all(paths, schema=first)
    assert rows["userid"] == [str(int(v)) for v in whole["userid"][:4]]
    ids, _ = whole["hist0"]
    assert rows["hist0"][:2] == [f"[{int(ids[0])}]", f"[{int(ids[1])}, {int(ids[2])}]"]  # 1 id, then 2


def test_a_written_schema_read_back_shows_the_same_records(tmp_path, capsys):
    path = tmp_path / "clicks.csv"
    path.write_text("y,price,count,city\n1,2.5,3,paris\n0,,7,\n1,1.0,,berlin\n")
    out_schema = tmp_path / "schema.json"
    code, inferred, err = _inspect(capsys, path, "--label", "y", "--rows", 100, "--write-schema", out_schema)
    assert code == 0 and not err
    assert json.loads(out_schema.read_text())["label"] == "y"
    assert "text layout: delimiter ','" in inferred and "a header line names the columns" in inferred
    code, given, err = _inspect(capsys, path, "--schema", out_schema)
    assert code == 0 and not err
    assert f"schema: from {out_schema}" in given

    def body(out):
        return [line for line in out.splitlines() if not line.startswith(("schema:", "schema written"))]

    assert body(given) == body(inferred)
    rows = _rows(given)
    assert rows["y"] == ["1", "0", "1"] and rows["price"] == ["2.5", "0", "1"]
    assert rows["count"] == ["3", "7", "0"]  # a missing id: row 0


def test_criteo_text_without_options_is_read_in_criteos_layout(tmp_path, capsys):
    data = synthetic_ctr(1000, seed=0, test_size=10)
    write_ctr(str(tmp_path), [next(data.batches(8, seed=1))], "criteo")
    code, out, err = _inspect(capsys, tmp_path, "--rows", 1000, "--head", 2)
    assert code == 0 and not err
    assert "Criteo's layout (40 tab-separated fields, no header)" in out
    assert "text layout: delimiter '\\t'" in out and "no header, 40 fields named by the schema" in out
    assert "records not counted" in out
    rows = _rows(out)
    assert len(rows["label"]) == 2 and len(rows["I13"]) == 2 and len(rows["C26"]) == 2
    assert all(0 <= int(v) < 1000 for v in rows["C1"])


def test_no_label_and_no_schema_is_one_line_naming_the_columns(tmp_path, capsys):
    path = tmp_path / "clicks.csv"
    path.write_text("y,price\n1,2.5\n")
    code, out, err = _inspect(capsys, path)
    assert code == 2 and not out
    assert err.startswith("towerflow data inspect: error: ") and err.count("\n") == 1
    assert "--label NAME" in err and "y, price" in err and "--schema FILE" in err
    code, out, err = _inspect(capsys, tmp_path / "absent")
    assert code == 2 and err.startswith("towerflow data inspect: error: no such file")
    (tmp_path / "bad.json").write_text("{\"label\": \"y\", \"dense\": [{\"name\": \"price\", \"transform\": \"exp\"}]}")
    code, out, err = _inspect(capsys, path, "--schema", tmp_path / "bad.json")
    assert code == 2 and "transform='exp'" in err and "Traceback" not in err


def test_files_without_records_are_an_error_not_a_wait(tmp_path, capsys):
    path = tmp_path / "empty.csv"
    path.write_text("y,price\n")
    code, out, err = _inspect(capsys, path, "--label", "y")
    assert code == 2 and err == "towerflow data inspect: error: no records in 1 text file: nothing to show or to " \
        "train on\n"
