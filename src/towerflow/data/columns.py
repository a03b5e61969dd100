"""An Arrow record batch turned into a `Features` batch by a schema: each column converted by its kind.

Text columns arrive as strings and are parsed here (pyarrow's casts, surrounding blanks ignored);
Parquet and Arrow columns arrive typed. A value that does not convert (a word in a numeric column, a
non-hex categorical, a missing label) marks its record bad: an error naming the file, the line (text) or
row (Parquet, Arrow, counted from 0), the column and the value, or with `on_bad_record="skip"` the record
is dropped and counted.
"""

from __future__ import annotations

import re
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from towerflow.data.features import FeatureNames, Features
from towerflow.data.hashing import hex_ids, stable_hash
from towerflow.data.schema import Categorical, CategoricalList, Dense, Schema
from towerflow.errors import DataError

Locate = Callable[[int], str]  # a record's index in the batch -> "FILE, line N" / "FILE, row N"
_NUMBER = re.compile(r"^\s*[-+]?(\d+\.?\d*([eE][-+]?\d+)?|\.\d+([eE][-+]?\d+)?|nan|inf|infinity)\s*$", re.IGNORECASE)
_INTEGER = re.compile(r"^\s*[-+]?\d+\s*$")


class _Bad:
    """The records found bad so far, and the first one's account."""

    def __init__(self, rows: int):
        self.mask = np.zeros(rows, dtype=bool)
        self.first: Optional[Tuple[int, str]] = None  # (record, what is wrong with it)

    def mark(self, where: np.ndarray, column: str, values, expected: str) -> None:
        """Mark the records `where` is true; `values` (an Arrow array, or a function of the record) says what was
        found there."""
        if not where.any():
            return
        row = int(np.argmax(where))
        if self.first is None or row < self.first[0]:
            value = values(row) if callable(values) else values[row].as_py()
            shown = "a missing value" if value is None else repr(value[:60] if isinstance(value, str) else value)
            self.first = (row, f"column {column!r}: {shown} is not {expected}")
        self.mask |= where


def to_features(batch, schema: Schema, names: FeatureNames, locate: Locate,
                on_bad_record: str = "error") -> Tuple[Features, int]:
    """The batch's records as `Features` by `schema`, and how many bad ones were skipped."""
    present = set(batch.schema.names)
    missing = [n for n in schema.needed if n not in present]
    if missing:
        raise DataError(f"{locate(0).split(',')[0]} lacks the columns {missing[:6]}{' ...' if len(missing) > 6 else ''}"
                        f" that the schema reads; its columns are {sorted(present)[:12]}: declare the schema by these "
                        "names (towerflow data inspect PATH prints what it finds)")
    n = batch.num_rows
    bad = _Bad(n)
    label, missing = _numbers(batch.column(schema.label), schema.label, bad, "a number")
    bad.mark(missing, schema.label, batch.column(schema.label), "a label")
    dense = np.empty((n, len(schema.dense)), dtype=np.float32)
    for j, column in enumerate(schema.dense):
        dense[:, j] = _dense(batch.column(column.name), column, bad)
    ids = np.empty((n, len(schema.categoricals)), dtype=np.int64)
    for j, column in enumerate(schema.categoricals):
        ids[:, j] = _rows(_ids(batch.column(column.name), column, bad), schema.rows_of(column))
    bags: List[Tuple[np.ndarray, np.ndarray]] = []
    for column in schema.lists:
        values, counts, owner = _list(batch.column(column.name), column, bad)
        bags.append((_rows(values, schema.rows_of(column)), counts, owner))
    skipped = 0
    if bad.first is not None:
        row, what = bad.first
        if on_bad_record != "skip":
            raise DataError(f"{locate(row)}, {what}; fix the value, declare the column by what it holds, or pass "
                            "on_bad_record='skip' to count and skip such records")
        keep = ~bad.mask
        skipped = int(bad.mask.sum())
        label, dense, ids = label[keep], dense[keep], ids[keep]
        bags = [(values[keep[owner]], counts[keep], owner) for values, counts, owner in bags]
    return Features(names, torch.from_numpy(dense), torch.from_numpy(ids),
                    tuple((torch.from_numpy(v), torch.from_numpy(c)) for v, c, _ in bags),
                    torch.from_numpy(label.astype(np.float32))), skipped


def _nulls(col) -> np.ndarray:
    import pyarrow.compute as pc

    return pc.is_null(col).to_numpy(zero_copy_only=False)


def _numbers(col, name: str, bad: _Bad, expected: str) -> Tuple[np.ndarray, np.ndarray]:
    """(float64 values, where they are missing); text that is not a number marks its record bad."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        try:
            col = pc.cast(col, pa.float64())  # plain numbers, the common case: one pass
        except pa.ArrowInvalid:
            col = pc.utf8_trim_whitespace(col)
            col = pc.if_else(pc.equal(col, ""), pa.scalar(None, col.type), col)  # a blank field is a missing value
        try:
            col = pc.cast(col, pa.float64())
        except pa.ArrowInvalid:
            lowered = pc.utf8_lower(col)  # true / false, as inference reads a column of them: 1 / 0
            col = pc.if_else(pc.equal(lowered, "true"), "1", pc.if_else(pc.equal(lowered, "false"), "0", col))
            ok = pc.match_substring_regex(col, _NUMBER.pattern, ignore_case=True)
            wrong = pc.invert(pc.fill_null(ok, True)).to_numpy(zero_copy_only=False)
            bad.mark(wrong, name, col, expected)
            col = pc.cast(pc.if_else(ok, col, pa.scalar(None, pa.string())), pa.float64())
    elif pa.types.is_boolean(col.type) or pa.types.is_integer(col.type) or pa.types.is_floating(col.type) \
            or pa.types.is_decimal(col.type):
        col = pc.cast(col, pa.float64())
    else:
        raise DataError(f"column {name!r} holds {col.type}: expected numbers; declare it as a categorical if it holds "
                        "ids or text")
    return col.to_numpy(zero_copy_only=False).astype(np.float64, copy=False), _nulls(col)


def _dense(col, column: Dense, bad: _Bad) -> np.ndarray:
    values, missing = _numbers(col, column.name, bad, "a number")
    values = np.where(missing, column.fill, values)
    if column.transform == "log1p":
        return np.log1p(np.maximum(values, 0.0))
    if column.transform == "standardize":
        if column.std is None:
            raise DataError(f"dense column {column.name!r} is standardized but its mean and std are not fitted: "
                            "give them, or let the stream fit them from a sample (FileStream does)")
        return (values - column.mean) / column.std
    return values


def _ids(col, column: Categorical, bad: _Bad) -> np.ndarray:
    """int64 ids of one-id values (missing: 0)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if column.kind == "string":  # a missing value is row 0, as for the other kinds
        return np.where(_nulls(col), 0, stable_hash(col if _is_text(col.type) else pc.cast(col, pa.string())))
    if column.kind == "hex" and _is_text(col.type):  # (an integer column holds the numbers already)
        values, wrong = hex_ids(col)
        bad.mark(wrong, column.name, col, "a hex number")
        return values
    if pa.types.is_integer(col.type):
        return pc.fill_null(col, 0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    if _is_text(col.type):
        col = pc.utf8_trim_whitespace(col)
        try:
            col = pc.cast(col, pa.int64())
        except pa.ArrowInvalid:
            ok = pc.match_substring_regex(col, _INTEGER.pattern)
            bad.mark(pc.invert(pc.fill_null(ok, True)).to_numpy(zero_copy_only=False), column.name, col,
                     "an integer id (declare the column kind='string' to hash text)")
            col = pc.cast(pc.if_else(ok, col, pa.scalar(None, pa.string())), pa.int64())
        return pc.fill_null(col, 0).to_numpy(zero_copy_only=False)
    if pa.types.is_floating(col.type):  # integer ids stored as floats, as pandas does with missing values
        values = pc.fill_null(col, 0).to_numpy(zero_copy_only=False)
        bad.mark(~np.isfinite(values) | (values != np.round(values)), column.name, col, "an integer id")
        return np.nan_to_num(values).astype(np.int64)
    raise DataError(f"column {column.name!r} holds {col.type}: expected integer ids, or kind='string' to hash its "
                    "values")


def _list(col, column: CategoricalList, bad: _Bad) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, each record's count, each id's record) of a list column (missing or empty: an empty bag)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if _is_text(col.type):
        col = pc.split_pattern(pc.if_else(pc.equal(col, ""), pa.scalar(None, col.type), col), column.delimiter)
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        raise DataError(f"list column {column.name!r} holds {col.type}: expected a list of ids, or text with ids "
                        f"split by {column.delimiter!r}")
    counts = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(col)
    owner = np.repeat(np.arange(len(counts)), counts)
    if _is_text(flat.type):
        flat = pc.utf8_trim_whitespace(flat)  # 'a | b': the ids 'a' and 'b', as a one-id column trims its value
        keep = pc.and_(pc.is_valid(flat), pc.not_equal(flat, ""))
    else:
        keep = pc.is_valid(flat)
    keep = keep.to_numpy(zero_copy_only=False)
    if not keep.all():  # no ids for the nulls in a list, the empty pieces of 'a||b' or of a trailing delimiter
        flat = flat.filter(pa.array(keep))
        owner = owner[keep]
        counts = np.bincount(owner, minlength=len(counts)).astype(np.int64)
    element = Categorical(column.name, column.rows, column.kind, column.table)
    inner = _Bad(len(flat))
    values = _ids(flat, element, inner)
    if inner.first is not None:
        first_bad = flat[inner.first[0]].as_py()
        bad.mark(np.bincount(owner[inner.mask], minlength=len(counts)) > 0, column.name, lambda row: first_bad,
                 f"{'an' if column.kind == 'int' else 'a'} {column.kind} id (in a list)")
    return values, counts, owner


def _rows(ids: np.ndarray, rows: Optional[int]) -> np.ndarray:
    """Ids into a table's rows (negative ids too); raw where the table maps ids itself."""
    return ids if rows is None else np.mod(ids, rows)


def _is_text(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)

