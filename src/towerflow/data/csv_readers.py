"""pyarrow's streaming CSV reader, opened and closed so that the end of the process never races its threads.

The reader keeps our Python row handler, and pyarrow's I/O threads go on parsing ahead for a moment after
the reader is closed. The thread that lets go of the handler last takes the GIL to drop it; doing so once
the interpreter has begun to finalize aborts the whole process ("terminate called without an active
exception", exit code -6). So every handler given to a reader is an object of its own, watched by a weak
reference once its reader is closed, and the exit hook waits until pyarrow has let go of all of them.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from typing import Callable, Iterator, List

from towerflow._waiting import wait_until

EXIT_WAIT_S = 5.0  # the most the process's exit waits for pyarrow's threads to let go of the closed readers

_closed: List[weakref.ref] = []  # the row handlers of closed readers that pyarrow may still hold
_closed_lock = threading.Lock()


class _RowHandler:
    """The row handler pyarrow keeps: an object only pyarrow refers to, so that its death says pyarrow let go."""

    def __init__(self, on_row: Callable[[object], str]):
        self.on_row = on_row

    def __call__(self, row) -> str:
        return self.on_row(row)


@contextlib.contextmanager
def csv_reader(source, read_options, delimiter: str, on_invalid_row: Callable[[object], str],
               convert_options=None, ignore_empty_lines: bool = True) -> Iterator[object]:
    """pyarrow's streaming reader of `source` (an input stream); `on_invalid_row(row)` is pyarrow's
    invalid_row_handler. The reader is closed on leaving the block."""
    import pyarrow.csv

    handler = _RowHandler(on_invalid_row)
    watch = weakref.ref(handler)
    parse = pyarrow.csv.ParseOptions(delimiter=delimiter, invalid_row_handler=handler,
                                     ignore_empty_lines=ignore_empty_lines)
    del handler
    try:
        reader = pyarrow.csv.open_csv(source, read_options=read_options, parse_options=parse,
                                      convert_options=convert_options)
    except BaseException:
        _watch(watch)
        raise
    finally:
        del parse
    try:
        yield reader
    finally:
        reader.close()
        _watch(watch)


def _watch(handler: weakref.ref) -> None:
    with _closed_lock:
        _closed[:] = [h for h in _closed if h() is not None]
        _closed.append(handler)


def _settle() -> None:
    """At exit: wait until pyarrow has dropped the handlers of the closed readers (those of a reader still
    referred to by Python are dropped by Python itself, safely)."""
    def settled() -> bool:
        with _closed_lock:
            _closed[:] = [h for h in _closed if h() is not None]
            return not _closed
    wait_until(settled, EXIT_WAIT_S, "pyarrow's reader threads", interval=0.01, on_timeout=None)


atexit.register(_settle)
