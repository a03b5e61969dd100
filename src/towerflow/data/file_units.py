"""Which parts of which files each worker reads: the unit of sharding, assigned deterministically.

A unit is what one reader call returns: a Parquet row group, an Arrow IPC record batch, or a whole
text file (CSV, TSV, Criteo's lines; gzip'd or not). The units of every file, in sorted path order, are dealt round-robin over
the workers, so every worker computes the same plan from the same file list, a file split into
row groups serves more workers than there are files, and each record belongs to exactly one worker
per epoch. Text files have one unit each: a job with fewer text files than workers is refused.
"""

from __future__ import annotations

import dataclasses
import glob as _glob
import os
from typing import List, Sequence, Tuple, Union

from towerflow.errors import DataError

FORMATS = ("parquet", "arrow", "text", "criteo")  # criteo: text in Criteo's layout


@dataclasses.dataclass(frozen=True)
class Unit:
    """One reader call's worth of records: `part` is the row group or record batch index (0 for a text file)."""

    path: str
    part: int
    records: int  # -1 where unknown before reading (text)


def list_files(paths: Union[str, Sequence[str]]) -> List[str]:
    """The files of a glob, a folder (its files, sorted) or a list of paths; an empty result names what was asked."""
    asked = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    found: List[str] = []
    for entry in map(str, asked):
        if os.path.isdir(entry):
            found += [os.path.join(entry, f) for f in sorted(os.listdir(entry)) if not f.startswith(".")]
        elif any(c in entry for c in "*?["):
            found += sorted(_glob.glob(entry))
        elif os.path.exists(entry):
            found.append(entry)
        else:
            raise DataError(f"no such file: {entry!r}")
    files = sorted({os.path.abspath(f) for f in found if os.path.isfile(f)})
    if not files:
        raise DataError(f"no files match {asked if len(asked) > 1 else asked[0]!r}: expected a glob, a folder or "
                        "paths of data files")
    return files


def infer_format(files: Sequence[str]) -> str:
    """parquet, arrow or text from the files' extensions (.parquet; .arrow / .ipc / .feather; anything else is
    text); files of several kinds are refused."""
    kinds = {"parquet" if f.endswith(".parquet") else "arrow" if f.endswith((".arrow", ".ipc", ".feather"))
             else "text" for f in files}
    if len(kinds) > 1:
        raise DataError(f"the files mix formats ({', '.join(sorted(kinds))}): keep one format per folder, or pass "
                        "format= explicitly")
    return kinds.pop()


def units_of(files: Sequence[str], fmt: str) -> List[Unit]:
    """Every unit of `files`, in file order then part order."""
    if fmt not in FORMATS:
        raise DataError(f"format={fmt!r}: expected one of {', '.join(FORMATS)}")
    if fmt in ("text", "criteo"):
        return [Unit(f, 0, -1) for f in files]
    from towerflow.data import file_formats

    out: List[Unit] = []
    for f in files:
        out += [Unit(f, i, n) for i, n in enumerate(file_formats.part_sizes(f, fmt))]
    return out


def assign(units: Sequence[Unit], worker: int, num_workers: int) -> Tuple[Unit, ...]:
    """This worker's units: every `num_workers`-th from `worker` on; a worker left with none is refused."""
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise DataError(f"worker={worker!r} with num_workers={num_workers!r}: expected 0 <= worker < num_workers")
    mine = tuple(units[worker::num_workers])
    if not mine:
        unit = "text files" if units and units[0].records < 0 else "row groups / record batches"
        raise DataError(
            f"{len(units)} {unit} for {num_workers} workers: worker {worker} would read nothing; write the data in "
            f"at least {num_workers} files (or, for Parquet and Arrow, row groups), or use fewer workers"
        )
    return mine
