"""Text read as pandas reads it: lines with stripped trailing fields have those fields missing and stay in
their place, blank lines are skipped, and every record keeps its line, across the reader's blocks too."""

from __future__ import annotations

import math

import pytest

from towerflow.data import Categorical, Dense, Schema, read_all, text_files
from towerflow.data.file_stream import FileStream
from towerflow.errors import DataError

BLOCKS = [1 << 20, 64]  # one block, and blocks of a few lines: the reader parses a block ahead


def _criteo_line(i, fields=40):
    """Criteo's 40 fields for record `i` (label, I1 = i, I2..I13 = 1, C1 = hex(i), C2..C26 = 'a'), cut to `fields`."""
    full = [str(i % 2), str(i)] + ["1"] * 12 + [format(i, "x")] + ["a"] * 25
    return "\t".join(full[:fields])


@pytest.mark.parametrize("block", [1 << 20, 300])  # 300 bytes: a block holds 2 or 3 of these lines
def test_criteo_lines_with_37_and_38_fields_keep_their_place_with_the_stripped_columns_missing(tmp_path, monkeypatch,
                                                                                                block):
    monkeypatch.setattr(text_files, "TEXT_BLOCK", block)
    widths = {3: 37, 4: 38, 10: 38, 11: 37, 12: 37, 29: 37}  # the last record's line is stripped too
    (tmp_path / "day_0").write_text("".join(_criteo_line(i, widths.get(i, 40)) + "\n" for i in range(30)))
    batch = read_all(str(tmp_path), "criteo", schema=Schema.criteo(1000))
    assert batch.labels.tolist() == [i % 2 for i in range(30)]
    assert batch["I1"].tolist() == pytest.approx([math.log1p(i) for i in range(30)])  # record order is file order
    assert batch["C1"].tolist() == list(range(30))
    for i in range(30):
        present = widths.get(i, 40) - 14  # of the 26 categoricals
        assert batch.ids[i, 1:].tolist() == [10] * (present - 1) + [0] * (26 - present), i  # missing: row 0


@pytest.mark.parametrize("block", BLOCKS)
def test_a_header_csv_with_short_and_blank_lines_reads_every_record_in_order(tmp_path, monkeypatch, block):
    monkeypatch.setattr(text_files, "TEXT_BLOCK", block)
    lines, expected = ["click,price,user"], []
    for i in range(60):
        if i % 9 == 4:
            lines.append("")  # blank: skipped
            continue
        if i % 7 == 2:
            lines.append(f"{i % 2},{i}")  # user stripped: missing
            expected.append((i % 2, float(i), 0))
        else:
            lines.append(f"{i % 2},{i},{i + 1}")
            expected.append((i % 2, float(i), (i + 1) % 50))
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n\n")
    batch = read_all(str(tmp_path / "train.csv"), schema=Schema("click", (Dense("price"), Categorical("user", 50))))
    got = list(zip(batch.labels.int().tolist(), batch["price"].tolist(), batch["user"].tolist()))
    assert got == expected


@pytest.mark.parametrize("block", BLOCKS)
def test_a_bad_value_is_named_by_its_line_past_short_and_blank_lines(tmp_path, monkeypatch, block):
    monkeypatch.setattr(text_files, "TEXT_BLOCK", block)
    lines = ["click,price,user"] + [f"0,{i}" if i % 3 else "" for i in range(40)] + ["1,lots,3"]
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    schema = Schema("click", (Dense("price"), Categorical("user", 50)))
    with pytest.raises(DataError, match=r"train.csv, line 42, column 'price': 'lots' is not a number"):
        read_all(str(tmp_path / "train.csv"), schema=schema)


@pytest.mark.parametrize("block", BLOCKS)
def test_too_long_lines_are_named_or_skipped_and_counted(tmp_path, monkeypatch, block):
    monkeypatch.setattr(text_files, "TEXT_BLOCK", block)
    lines = ["click,price,user"] + [f"1,{i},{i},extra" if i in (5, 17, 29) else f"0,{i},{i}" for i in range(30)]
    (tmp_path / "train.csv").write_text("\n".join(lines) + "\n")
    schema = Schema("click", (Dense("price"), Categorical("user", 50)))
    with pytest.raises(DataError, match=r"train.csv, line 7: 4 fields, expected 3"):
        read_all(str(tmp_path / "train.csv"), schema=schema)
    stream = FileStream(str(tmp_path / "train.csv"), batch_size=100, schema=schema, on_bad_record="skip")
    batch = next(iter(stream))
    assert batch["price"].tolist() == [i for i in range(30) if i not in (5, 17, 29)]
    assert stream.bad_records == 3
