"""The features of a dataset, declared once: what the reader reads, the model takes and the tables hold.

A `Schema` names the label column and every feature column with its kind:
* `Dense`: a number, missing as `fill`, then transformed (`log1p` of the value clipped at 0, as Criteo's
  users read counts; `standardize` by a mean and std, fitted from a sample when not given; or `none`);
* `Categorical`: one id per record: an integer, a string hashed with `hashing.stable_hash`, or hex digits;
  taken modulo its table's `rows` (a missing value is row 0); `rows=None` keeps the raw 63-bit id, for a
  table that maps ids to rows itself (`towerflow.ps.HashEmbedding`);
* `CategoricalList`: several ids per record (an Arrow list, or a delimited string in text), pooled by an
  `EmbeddingBag`; a missing or empty value is an empty bag.
Each categorical feeds a table, its own by default; columns that name the same `table` share it (as TF's
shared embedding columns). Text files add their layout: the delimiter, whether a header line names the
columns, and the field names of a file without one.

Schemas are written in Python, inferred from a file (`Schema.infer`), or loaded from a small JSON or YAML
file (`Schema.load`); `Schema.criteo(rows)` is Criteo's layout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from towerflow._io import atomic_write
from towerflow.errors import DataError

TRANSFORMS = ("none", "log1p", "standardize")
KINDS = ("int", "string", "hex")
CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_CATS = tuple(f"C{i}" for i in range(1, 27))


@dataclasses.dataclass(frozen=True)
class Dense:
    """A numeric feature: missing as `fill`, then `transform` (none, log1p, standardize by mean and std)."""

    name: str
    transform: str = "none"
    fill: float = 0.0
    mean: Optional[float] = None
    std: Optional[float] = None

    def check(self) -> None:
        if self.transform not in TRANSFORMS:
            raise DataError(f"dense column {self.name!r}: transform={self.transform!r}, expected one of "
                            f"{', '.join(TRANSFORMS)}")
        if self.std is not None and not self.std > 0:
            raise DataError(f"dense column {self.name!r}: std={self.std!r}, expected a positive number")
        if (self.mean is None) != (self.std is None):
            raise DataError(f"dense column {self.name!r}: give both mean and std, or neither (fitted from a sample)")

    @property
    def fitted(self) -> bool:
        return self.transform != "standardize" or self.std is not None


@dataclasses.dataclass(frozen=True)
class Categorical:
    """One id per record (`kind`: int, string or hex), in the rows of `table` (its own name by default)."""

    name: str
    rows: Optional[int] = None
    kind: str = "int"
    table: Optional[str] = None

    @property
    def table_name(self) -> str:
        return self.table or self.name

    def check(self) -> None:
        if self.kind not in KINDS:
            raise DataError(f"column {self.name!r}: kind={self.kind!r}, expected one of {', '.join(KINDS)} "
                            "(string hashes any text)")
        if self.rows is not None and (not isinstance(self.rows, int) or isinstance(self.rows, bool) or self.rows < 1):
            raise DataError(f"column {self.name!r}: rows={self.rows!r}, expected a positive integer (the table's "
                            "rows), or None to keep raw ids for a hash table")


@dataclasses.dataclass(frozen=True)
class CategoricalList(Categorical):
    """Several ids per record, pooled in one bag: an Arrow list, or text split at `delimiter`."""

    delimiter: str = "|"

    def check(self) -> None:
        super().check()
        if not self.delimiter:
            raise DataError(f"list column {self.name!r}: an empty delimiter; give the character between its ids")


Column = Union[Dense, Categorical, CategoricalList]


@dataclasses.dataclass(frozen=True)
class TextLayout:
    """How text files hold the columns: `delimiter` (None: ',' for .csv, a tab otherwise), whether the first
    line is a `header` (None: yes, unless `names` are given), and `names`, the fields of a file without one."""

    delimiter: Optional[str] = None
    header: Optional[bool] = None
    names: Optional[Tuple[str, ...]] = None

    @property
    def has_header(self) -> bool:
        return self.header if self.header is not None else self.names is None

    def delimiter_for(self, path: str) -> str:
        if self.delimiter is not None:
            return self.delimiter
        base = path[:-3] if path.endswith(".gz") else path
        return "," if base.endswith(".csv") else "\t"


@dataclasses.dataclass(frozen=True)
class Schema:
    """The label column and the feature columns of a dataset, with the tables they feed."""

    label: str
    columns: Tuple[Column, ...]
    text: TextLayout = TextLayout()

    def __post_init__(self):
        object.__setattr__(self, "columns", tuple(self.columns))
        if self.text.names is not None:
            object.__setattr__(self, "text", dataclasses.replace(self.text, names=tuple(self.text.names)))
        if not isinstance(self.label, str) or not self.label:
            raise DataError(f"label={self.label!r}: expected the name of the label column")
        names = [c.name for c in self.columns]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise DataError(f"the schema names the columns {repeated} more than once: one declaration per column")
        if self.label in names:
            raise DataError(f"the label {self.label!r} is also declared as a feature: a column is one or the other")
        for column in self.columns:
            if not isinstance(column, (Dense, Categorical)):
                raise DataError(f"{column!r} is not a column: expected Dense, Categorical or CategoricalList")
            column.check()
        self.tables  # rows agree among the columns sharing a table
        if self.text.names is not None:
            absent = [n for n in [self.label, *names] if n not in self.text.names]
            if absent:
                raise DataError(f"text names={list(self.text.names)} lack the schema's columns {absent}: name every "
                                "field of a headerless file, in order")
            for column in self.lists:
                if column.delimiter == self.text.delimiter:
                    raise DataError(f"list column {column.name!r} splits at {column.delimiter!r}, the files' own "
                                    "delimiter: give it another one")

    # ---- the columns by kind
    @property
    def dense(self) -> Tuple[Dense, ...]:
        return tuple(c for c in self.columns if isinstance(c, Dense))

    @property
    def categoricals(self) -> Tuple[Categorical, ...]:
        """The one-id columns, in declaration order."""
        return tuple(c for c in self.columns if type(c) is Categorical)

    @property
    def lists(self) -> Tuple[CategoricalList, ...]:
        return tuple(c for c in self.columns if isinstance(c, CategoricalList))

    @property
    def needed(self) -> List[str]:
        """The file columns the schema reads: the label, then the features."""
        return [self.label, *(c.name for c in self.columns)]

    @functools.cached_property
    def tables(self) -> Dict[str, Optional[int]]:
        """Each table's rows (None: raw ids, for a hash table), in the order its first column is declared."""
        out: Dict[str, Optional[int]] = {}
        for column in (*self.categoricals, *self.lists):
            name, rows = column.table_name, column.rows
            if name in out and rows is not None and out[name] is not None and out[name] != rows:
                raise DataError(f"table {name!r} is given {out[name]} rows and {rows} rows by its columns: the columns "
                                "sharing a table share its rows")
            out[name] = rows if out.get(name) is None else out[name]
        return out

    def rows_of(self, column: Categorical) -> Optional[int]:
        """The rows of the table a column feeds (a column sharing a table may leave them to another)."""
        return self.tables[column.table_name]

    @property
    def fitted(self) -> bool:
        return all(c.fitted for c in self.dense)

    # ---- presets
    @classmethod
    def criteo(cls, rows_per_table: Union[int, Sequence[int]] = 1_000_000, dense_transform: str = "log1p") -> "Schema":
        """Criteo's layout: a label, 13 counts read as log(1 + x), 26 hex categoricals, tab-separated, no header."""
        rows = [rows_per_table] * 26 if isinstance(rows_per_table, int) else list(rows_per_table)
        if len(rows) != 26:
            raise DataError(f"rows_per_table has {len(rows)} entries: expected 26, one per categorical column")
        return cls("label", (*(Dense(n, dense_transform) for n in CRITEO_DENSE),
                             *(Categorical(n, r, "hex") for n, r in zip(CRITEO_CATS, rows))),
                   TextLayout("\t", False, ("label", *CRITEO_DENSE, *CRITEO_CATS)))

    @property
    def is_criteo(self) -> bool:
        """Whether the columns are Criteo's, in its order (the batches can then be the (dense, cats, labels) tuples)."""
        return (self.label == "label" and tuple(c.name for c in self.dense) == CRITEO_DENSE
                and tuple(c.name for c in self.categoricals) == CRITEO_CATS and not self.lists)

    # ---- files
    @classmethod
    def infer(cls, path: str, label: str, **options) -> "Schema":
        """The schema of a Parquet or Arrow file's columns, or of a text file's header and first rows
        (`schema_infer.infer`: its options name the rows, the dense columns and the columns to leave out)."""
        from towerflow.data.schema_infer import infer

        return infer(path, label, **options)

    def to_dict(self) -> dict:
        out: dict = {"label": self.label}
        for key, kind in (("dense", Dense), ("categorical", None), ("lists", CategoricalList)):
            chosen = [c for c in self.columns if (type(c) is Categorical if kind is None else isinstance(c, kind))]
            if chosen:
                out[key] = [{k: v for k, v in dataclasses.asdict(c).items()
                             if v != _DEFAULTS[type(c)].get(k) or k == "name"} for c in chosen]
        text = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self.text).items()
                if v is not None}
        if text:
            out["text"] = text
        return out

    @classmethod
    def from_dict(cls, spec: Mapping, source: str = "a schema") -> "Schema":
        unknown = sorted(set(spec) - {"label", "dense", "categorical", "lists", "text"})
        if unknown:
            raise DataError(f"{source}: unknown keys {unknown}; expected label, dense, categorical, lists, text")
        if "label" not in spec:
            raise DataError(f"{source}: no 'label': name the label column")
        columns: List[Column] = []
        for key, kind in (("dense", Dense), ("categorical", Categorical), ("lists", CategoricalList)):
            for entry in spec.get(key) or ():
                entry = {"name": entry} if isinstance(entry, str) else entry
                try:
                    columns.append(kind(**entry))
                except TypeError as e:
                    fields = [f.name for f in dataclasses.fields(kind)]
                    raise DataError(f"{source}: {key} entry {entry!r}: {e}; its fields are {fields}") from None
        text = dict(spec.get("text") or {})
        try:
            layout = TextLayout(**{**text, **({"names": tuple(text["names"])} if text.get("names") else {})})
        except TypeError as e:
            raise DataError(f"{source}: text {text!r}: {e}; expected delimiter, header, names") from None
        return cls(spec["label"], tuple(columns), layout)

    @classmethod
    def load(cls, path: str) -> "Schema":
        """A schema from a JSON or YAML file (by its extension)."""
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise DataError(f"cannot read the schema file {path!r}: {e.strerror}") from None
        if path.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError:
                raise DataError(f"{path}: reading YAML needs PyYAML: pip install pyyaml (or write the schema as "
                                "JSON)") from None
            try:
                spec = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise DataError(f"{path}: not valid YAML ({e})") from None
        else:
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})") from None
        if not isinstance(spec, dict):
            raise DataError(f"{path}: expected a mapping with label, dense, categorical, lists, text")
        return cls.from_dict(spec, path)

    def save(self, path: str) -> str:
        """Written atomically as JSON (YAML for a .yaml/.yml path); the path."""
        spec = self.to_dict()
        if path.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(spec, sort_keys=False)
        else:
            text = json.dumps(spec, indent=2) + "\n"
        with atomic_write(path, "w") as f:
            f.write(text)
        return path

    def with_stats(self, stats: Mapping[str, Tuple[float, float]]) -> "Schema":
        """The schema with the standardized columns' (mean, std) set from `stats` (a std of 0 becomes 1)."""
        columns = tuple(dataclasses.replace(c, mean=float(stats[c.name][0]),
                                            std=float(stats[c.name][1]) if stats[c.name][1] > 0 and
                                            math.isfinite(stats[c.name][1]) else 1.0)
                        if isinstance(c, Dense) and not c.fitted else c for c in self.columns)
        return dataclasses.replace(self, columns=columns)


_DEFAULTS = {kind: {f.name: f.default for f in dataclasses.fields(kind)} for kind in (Dense, Categorical, CategoricalList)}
