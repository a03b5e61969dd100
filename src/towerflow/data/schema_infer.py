"""A schema learned from the data: the columns of a file, and the statistics of standardized features.

`infer` reads a Parquet or Arrow file's own schema, or a text file's header and first block (as pyarrow
infers their types, like pandas): floats and booleans become dense features, integers and strings
categoricals (an integer column that counts something, like Criteo's I1..I13, is named in `dense=`), lists
list columns. `fit` computes the mean and std of the standardized columns from the first records of the
files in sorted order, so every worker fits the same numbers without talking to the others.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from towerflow.data.csv_readers import csv_reader
from towerflow.data.schema import Categorical, CategoricalList, Dense, Schema, TextLayout
from towerflow.errors import DataError

DEFAULT_ROWS = 1_000_000
FIT_SAMPLE = 100_000


def infer(path: str, label: str, rows: Union[int, Mapping[str, int]] = DEFAULT_ROWS, dense: Iterable[str] = (),
          dense_transform: str = "none", exclude: Iterable[str] = (), delimiter: Optional[str] = None,
          names: Optional[Sequence[str]] = None, list_delimiter: str = "|",
          lists: Iterable[str] = ()) -> Schema:
    """The schema of `path`'s columns (a file; a folder's first file). `rows`: the table rows of every
    categorical, or per column; `dense`: integer columns that are numbers, not ids; `exclude`: columns to
    leave out; for text, `delimiter` (default by extension), `names` for a file without a header, and `lists`:
    text columns holding ids split by `list_delimiter`."""
    from towerflow.data import file_units

    files = file_units.list_files(path)
    first = files[0]
    fmt = file_units.infer_format([first])
    types = _arrow_schema(first, fmt, delimiter, names)
    if label not in types.names:
        raise DataError(f"{first} has no column {label!r} for the label; its columns are {types.names[:20]}")
    dense, exclude, lists = set(dense), set(exclude), set(lists)
    unknown = (dense | exclude | lists) - set(types.names)
    if unknown:
        raise DataError(f"{first} has no columns {sorted(unknown)}; its columns are {types.names[:20]}")
    columns = []
    for field in types:
        name = field.name
        if name == label or name in exclude:
            continue
        columns.append(_column(name, field.type, _rows(rows, name), name in dense, dense_transform,
                               name in lists, list_delimiter, first))
    text = TextLayout(delimiter, None if names is None else False, tuple(names) if names else None) \
        if fmt == "text" else TextLayout()
    return Schema(label, tuple(columns), text)


def _rows(rows: Union[int, Mapping[str, int]], name: str) -> int:
    if isinstance(rows, Mapping):
        return int(rows.get(name, DEFAULT_ROWS))
    return int(rows)


def _column(name, arrow_type, rows, is_dense, transform, is_list, list_delimiter, path):
    import pyarrow as pa

    if is_list:
        return CategoricalList(name, rows, "string", delimiter=list_delimiter)
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        value = arrow_type.value_type
        return CategoricalList(name, rows, "int" if pa.types.is_integer(value) else "string")
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    if is_dense or pa.types.is_floating(arrow_type) or pa.types.is_boolean(arrow_type) or \
            pa.types.is_decimal(arrow_type):
        return Dense(name, transform)
    if pa.types.is_integer(arrow_type):
        return Categorical(name, rows, "int")
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_null(arrow_type):
        return Categorical(name, rows, "string")
    raise DataError(f"{path}, column {name!r}: {arrow_type} is neither a number, an id, text nor a list; leave it "
                    "out with exclude=")


def _arrow_schema(path: str, fmt: str, delimiter: Optional[str], names: Optional[Sequence[str]]):
    from towerflow.data import text_files
    from towerflow.data.file_formats import pyarrow

    pa = pyarrow()
    try:
        if fmt == "parquet":
            return pa.parquet.read_schema(path)
        if fmt == "arrow":
            with pa.memory_map(path) as source:
                return pa.ipc.open_file(source).schema
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable {fmt} file ({str(e).splitlines()[0]})") from None
    sep = TextLayout(delimiter).delimiter_for(path)
    read = pa.csv.ReadOptions(block_size=1 << 20, use_threads=False, column_names=list(names) if names else None)
    try:
        with csv_reader(text_files.open_text(path), read, sep, lambda row: "skip") as reader:
            return reader.schema
    except pa.ArrowInvalid as e:
        raise DataError(f"{path}: cannot infer its columns ({str(e).splitlines()[0]}); give names= for a file "
                        "without a header") from None


def fit(schema: Schema, layout_for_schema, files: Sequence[str], sample: int = FIT_SAMPLE) -> Schema:
    """`schema` with the mean and std of its standardized columns, from the first `sample` records of `files`."""
    if schema.fitted:
        return schema
    from towerflow.data import file_formats, file_units
    from towerflow.data.features import FeatureNames

    unfitted = Schema(schema.label, tuple(Dense(c.name, "none", c.fill) if isinstance(c, Dense) else c
                                          for c in schema.columns), schema.text)
    layout = layout_for_schema(unfitted)
    names = FeatureNames.of(unfitted)
    chunks = []
    have = 0
    for unit in file_units.units_of(files, layout.format):
        for chunk in file_formats.read_part(unit.path, unit.part, layout, 0, "skip"):
            features, _ = file_formats.to_features(chunk, layout, names, "skip")
            chunks.append(features.dense.double().numpy())
            have += len(features)
            if have >= sample:
                break
        if have >= sample:
            break
    if not have:
        raise DataError(f"no records in {files[0]} ... to fit the standardized columns' mean and std from")
    values = np.concatenate(chunks)[:sample]
    stats: Dict[str, tuple] = {}
    for j, column in enumerate(schema.dense):
        if not column.fitted:
            mean, std = float(values[:, j].mean()), float(values[:, j].std())
            stats[column.name] = (mean, std if std > 0 and math.isfinite(std) else 1.0)
    return schema.with_stats(stats)
