"""`towerflow data inspect PATH`: the files, the schema they are read by, and the first records as the model sees them.

The schema is a given file (`--schema`), inferred from the first file (`--label`), or Criteo's layout for
headerless text of 40 tab-separated fields. The records are read through `FileStream`, so what is printed
is what training gets: the dense values after their transform, the ids after hashing and the modulo of
their table's rows, each list column's bag of ids. `--write-schema` saves the schema to edit and train with.
"""

from __future__ import annotations

import os
import sys
from typing import List, Sequence

PROG = "towerflow data inspect"
CRITEO_FIELDS = 40
LISTED_FILES = 5  # files named one per line; the rest are counted


def register(sub) -> None:
    p = sub.add_parser("data", help="look at training data files: `towerflow data inspect PATH`")
    commands = p.add_subparsers(dest="data_command", metavar="COMMAND")
    p.set_defaults(func=lambda args: _usage(p))
    q = commands.add_parser(
        "inspect", help="the files, their schema and the first records as the model sees them",
        description="Show the files found, the schema they are read by (given, inferred or Criteo's) and the "
                    "first records as the model sees them: the label, the dense values after their transform, the "
                    "ids after hashing and modulo, each list column's bag of ids.")
    q.add_argument("path", help="a data file, a folder of them or a glob (quote it)")
    q.add_argument("--schema", metavar="FILE", help="read by this schema (JSON, or YAML by a .yaml/.yml name)")
    q.add_argument("--label", metavar="NAME", help="the label column; the rest of the schema is inferred from the "
                   "first file")
    q.add_argument("--rows", type=int, metavar="N", help="the rows of every inferred table (default 1000000)")
    q.add_argument("--format", choices=("parquet", "arrow", "text", "criteo"),
                   help="the files' format (default by extension: .parquet, .arrow/.ipc/.feather, else text)")
    q.add_argument("--head", type=int, default=5, metavar="N", help="records to show (default 5)")
    q.add_argument("--write-schema", metavar="OUT", help="save the schema (JSON, or YAML by a .yaml/.yml name) to "
                   "edit and pass to training")
    q.set_defaults(func=run)


def _usage(parser) -> int:
    parser.print_help()
    return 2


def run(args) -> int:
    from towerflow.errors import DataError

    try:
        inspect(args)
    except DataError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0


def inspect(args) -> None:
    from towerflow.data import file_units
    from towerflow.errors import DataError

    if args.head < 1:
        raise DataError(f"--head {args.head}: expected a positive number of records")
    if args.rows is not None and args.rows < 1:
        raise DataError(f"--rows {args.rows}: expected a positive number of table rows")
    files = file_units.list_files(args.path)
    fmt = args.format or file_units.infer_format(files)
    units = file_units.units_of(files, fmt)
    schema, source = _schema(args, files, fmt)
    _print_files(files, fmt, units)
    print(f"\nschema: {source}")
    _print_schema(schema, fmt, files[0])
    if args.write_schema:
        print(f"schema written to {_write(schema, args.write_schema)}")
    _print_head(files, fmt, schema, args.head)


# ---- the schema
def _schema(args, files: Sequence[str], fmt: str):
    """(schema, where it came from) for the files."""
    from towerflow.data import file_units
    from towerflow.data.schema import Schema
    from towerflow.errors import DataError

    first = files[0]
    if args.schema:
        schema = Schema.load(args.schema)
        if args.label and args.label != schema.label:
            raise DataError(f"--label {args.label!r}, but {args.schema} names {schema.label!r} as the label: drop "
                            "--label, or edit the schema file")
        return schema, f"from {args.schema}"
    rows = {} if args.rows is None else {"rows": args.rows}
    if args.label:
        if fmt == "criteo":
            raise DataError("--format criteo reads Criteo's own columns (label, I1..I13, C1..C26): drop --label, or "
                            "pass --format text to infer the columns of a file with a header")
        by_name = file_units.infer_format([first])
        if by_name != fmt:
            raise DataError(f"{first}: its name says {by_name}, not {fmt}, and the columns are inferred by the name: "
                            "rename the files, or pass --schema FILE")
        return Schema.infer(first, label=args.label, **rows), \
            f"inferred from {os.path.basename(first)}, label {args.label!r} (save it with --write-schema FILE to edit)"
    if fmt == "criteo" or (fmt == "text" and _looks_like_criteo(first)):
        why = "--format criteo" if fmt == "criteo" else \
            f"{os.path.basename(first)} has Criteo's layout ({CRITEO_FIELDS} tab-separated fields, no header)"
        return Schema.criteo(**({} if args.rows is None else {"rows_per_table": args.rows})), \
            f"Criteo's: {why}; pass --label NAME or --schema FILE to read it otherwise"
    found = _column_names(first, fmt)
    raise DataError(f"no --label and no --schema: pass --label NAME to infer the schema from {first} (its columns "
                    f"are {', '.join(found[:30])}{' ...' if len(found) > 30 else ''}), or --schema FILE")


def _looks_like_criteo(path: str) -> bool:
    """Whether a text file's first line is a Criteo record: 40 tab-separated fields, a 0/1 label first."""
    from towerflow.data import text_files

    try:
        with text_files.open_text(path) as f:
            start = f.read(1 << 16)  # the stream has no readline
    except OSError:
        return False
    fields = start.split(b"\n", 1)[0].decode("utf-8", "replace").rstrip("\r").split("\t")
    return len(fields) == CRITEO_FIELDS and fields[0].strip() in ("0", "1")


def _column_names(path: str, fmt: str) -> List[str]:
    from towerflow.data import text_files
    from towerflow.data.file_formats import pyarrow
    from towerflow.data.schema import TextLayout
    from towerflow.errors import DataError

    pa = pyarrow()
    try:
        if fmt == "parquet":
            return list(pa.parquet.read_schema(path).names)
        if fmt == "arrow":
            with pa.memory_map(path) as source:
                return list(pa.ipc.open_file(source).schema.names)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable {fmt} file ({str(e).splitlines()[0]})") from None
    return text_files.header_names(path, TextLayout().delimiter_for(path))


def _write(schema, path: str) -> str:
    from towerflow.errors import DataError

    try:
        return schema.save(path)
    except ImportError:
        raise DataError(f"{path}: writing YAML needs PyYAML: pip install pyyaml (or give a .json name)") from None
    except OSError as e:
        raise DataError(f"cannot write the schema to {path!r}: {e.strerror}") from None


# ---- what is printed
def _print_files(files: Sequence[str], fmt: str, units) -> None:
    size = sum(os.path.getsize(f) for f in files)
    if fmt in ("parquet", "arrow"):
        parts = "row groups" if fmt == "parquet" else "record batches"
        records = f"{sum(u.records for u in units):,} records in {len(units):,} {parts}"
    else:
        records = "records not counted (text is counted by reading it)"
    print(f"files: {len(files):,} {fmt} file{'s' if len(files) != 1 else ''}, {_size(size)}, {records}")
    for f in files[:LISTED_FILES]:
        print(f"  {f}")
    if len(files) > LISTED_FILES:
        print(f"  ... and {len(files) - LISTED_FILES:,} more")


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


def _print_schema(schema, fmt: str, first: str) -> None:
    from towerflow.data.schema import CategoricalList, Dense

    text = fmt in ("text", "criteo")
    rows = [("column", "kind", "transform / ids", "table", "rows"), (schema.label, "label", "", "", "")]
    for column in schema.columns:
        if isinstance(column, Dense):
            rows.append((column.name, "dense", _transform(column), "", ""))
            continue
        ids = {"string": "string, hashed", "hex": "hex", "int": "int"}[column.kind]
        if isinstance(column, CategoricalList) and text:
            ids += f", split at {column.delimiter!r}"
        table_rows = schema.rows_of(column)
        rows.append((column.name, "list" if isinstance(column, CategoricalList) else "categorical", ids,
                     column.table_name, "raw ids" if table_rows is None else f"{table_rows:,}"))
    _table(rows)
    tables = schema.tables
    known = [r for r in tables.values() if r is not None]
    print(f"features: {len(schema.dense)} dense, {len(schema.categoricals)} categorical, {len(schema.lists)} list; "
          f"{len(tables)} table{'s' if len(tables) != 1 else ''}"
          + (f", {sum(known):,} rows in all" if tables and len(known) == len(tables) else ""))
    if text:
        layout = schema.text
        delimiter = layout.delimiter_for(first)
        how = "given" if layout.delimiter is not None else "by the file name"
        header = "a header line names the columns" if layout.has_header else \
            f"no header, {len(layout.names)} fields named by the schema"
        print(f"text layout: delimiter {delimiter!r} ({how}), {header}")


def _transform(column) -> str:
    out = column.transform
    if column.transform == "standardize":
        out += f" (mean {column.mean:.4g}, std {column.std:.4g})" if column.fitted else \
            " (mean and std fitted from the first records)"
    if column.fill:
        out += f", missing as {column.fill:g}"
    return out


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print((indent + "  ".join(str(v).ljust(w) for v, w in zip(r, widths))).rstrip())


def _print_head(files: Sequence[str], fmt: str, schema, head: int) -> None:
    from towerflow.data.file_stream import FileStream
    from towerflow.errors import DataError

    stream = FileStream(files, fmt, batch_size=head, schema=schema)
    if not _any_record(stream):  # a stream of no records would wait for its first batch forever
        raise DataError(f"no records in {len(files)} {fmt} file{'s' if len(files) != 1 else ''}: nothing to show "
                        "or to train on")
    batches = iter(stream)
    try:
        batch = next(batches)
    finally:
        batches.close()
    n = len(batch)
    print(f"\nfirst {n} record{'s' if n != 1 else ''} as the model sees {'them' if n != 1 else 'it'} "
          "(dense after the transform, ids after hashing and the table's rows):")
    label = schema.label if schema.label == "label" else f"{schema.label} (label)"
    rows = [("feature", *(f"#{i}" for i in range(n))), (label, *(_number(v) for v in batch.labels))]
    for j, name in enumerate(batch.names.dense):
        rows.append((name, *(_number(v) for v in batch.dense[:, j])))
    for j, name in enumerate(batch.names.ids):
        rows.append((name, *(str(int(v)) for v in batch.ids[:, j])))
    for k, name in enumerate(batch.names.lists):
        values, counts = batch.bags[k]
        bags, start = [], 0
        for c in counts.tolist():
            bags.append("[" + ", ".join(str(int(v)) for v in values[start:start + c]) + "]")
            start += c
        rows.append((name, *bags))
    _table(rows)
    fitted = [c for c, was in zip(stream.schema.dense, schema.dense) if not was.fitted]
    if fitted:
        print("standardized with the mean and std of the first records: "
              + ", ".join(f"{c.name} ({c.mean:.4g}, {c.std:.4g})" for c in fitted))


def _any_record(stream) -> bool:
    """Whether the stream's files hold a record: by their metadata, or by reading text until the first one."""
    from towerflow.data import file_formats, file_units

    for unit in file_units.units_of(stream.files, stream.format):
        if unit.records > 0:
            return True
        if unit.records < 0 and any(chunk.batch.num_rows for chunk in file_formats.read_part(
                unit.path, unit.part, stream.layout)):
            return True
    return False


def _number(value) -> str:
    return f"{float(value):.6g}"

