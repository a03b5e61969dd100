"""One worker's batches from files: its units in order, shuffled in bounded windows, read ahead by a thread.

Shuffling is by window: the worker's records of an epoch are cut into windows of `shuffle_window`
records, and each window is permuted by a seed of (seed, epoch, window, worker). A position is then
the epoch and the records handed out in it: resuming re-reads the current window from its first
record (no buffer is saved) and skips what was handed out, so no record is trained on twice and none
is skipped. Memory holds one window and the read-ahead queue, whatever the data's size. A job restored
onto another number of workers first reads the old workers' remainders (`file_regroup.py`): the
position then also says which of them is being read.
"""

from __future__ import annotations

import atexit
import queue
import threading
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from towerflow.data import file_formats, file_regroup, file_units, schema_infer
from towerflow.data.features import FeatureNames, Features
from towerflow.data.file_formats import Layout
from towerflow.data.file_regroup import Handover, Plan, Resume
from towerflow.data.schema import Schema
from towerflow.errors import DataError

Batch = Union[Features, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class FileStream:
    """This worker's batches from files; `state_dict()` is its position.

    With a `schema` the batches are `Features`, keyed by feature name; without one the files are read in
    Criteo's layout with `rows_per_table` and the batches are (dense, cats, labels) tuples.
    `earlier`: the restores onto other worker counts that this job went through (oldest first); the
    stream then first reads the old workers' remainders that fall to this worker (`file_regroup.py`)."""

    def __init__(self, paths: Union[str, Sequence[str]], format: Optional[str] = None, batch_size: int = 1024,
                 rows_per_table: Optional[Sequence[int]] = None, worker: int = 0, num_workers: int = 1,
                 shuffle_window: int = 0, seed: int = 0, on_bad_record: str = "error", read_ahead: int = 4,
                 resume: Optional[Callable[[], Union[int, Resume]]] = None, earlier: Sequence[Handover] = (),
                 schema: Optional[Schema] = None):
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size!r}: expected a positive number of records per batch")
        if on_bad_record not in ("error", "skip"):
            raise DataError(f"on_bad_record={on_bad_record!r}: expected 'error' or 'skip'")
        self.files = file_units.list_files(paths)
        self.format = format or file_units.infer_format(self.files)
        self.batch_size = batch_size
        self.layout = file_formats.layout_for(self.files, self.format, schema, rows_per_table)
        self.layout = Layout(self.layout.format, schema_infer.fit(
            self.layout.schema, lambda s: Layout(self.layout.format, s), self.files))
        self.schema = self.layout.schema
        self.names = FeatureNames.of(self.schema)
        self.as_tuples = schema is None  # Criteo's layout from rows_per_table: the tuples it always handed out
        self._all_units = file_units.units_of(self.files, self.format)
        self.units = file_units.assign(self._all_units, worker, num_workers)
        self.worker, self.num_workers = worker, num_workers
        self.window = max(shuffle_window, batch_size)
        self.shuffle = shuffle_window > 0
        self.seed, self.on_bad_record, self.read_ahead = seed, on_bad_record, read_ahead
        # the position: the span of the plan being read (len(spans): this worker's own deal), its epoch, and
        # the records handed out in that epoch
        self.span, self.epoch, self.taken = 0, 0, 0
        self.bad_records = 0
        self._resume = resume  # where the worker's training stands when iteration starts (asked then)
        self._placed = False  # the position was set (loaded, sought or resumed)
        self._unit_records: Dict[int, int] = {}  # records of the units counted by reading (text)
        self.earlier: Tuple[Handover, ...] = ()
        self.plan = Plan(worker, num_workers)
        if earlier:
            self._regroup(earlier)

    # ---- the position
    def state_dict(self) -> Dict[str, object]:
        return {"epoch": self.epoch, "taken": self.taken, "worker": self.worker, "num_workers": self.num_workers,
                "span": self.span, "earlier": [[h.num_workers, list(h.batches)] for h in self.earlier]}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        if (state.get("worker"), state.get("num_workers")) != (self.worker, self.num_workers):
            raise DataError(f"a position of worker {state.get('worker')} of {state.get('num_workers')} cannot resume "
                            f"worker {self.worker} of {self.num_workers}: the files are dealt to the workers anew then; "
                            "to go on with another number of workers, pass earlier=[Handover(old count, each old "
                            "worker's batches)] (docs/data.md, \"Resuming on another number of workers\")")
        earlier = tuple(Handover(int(n), tuple(int(c) for c in b)) for n, b in state.get("earlier") or ())
        if earlier != self.earlier:
            raise DataError(f"a position of a stream restored as {list(earlier)} cannot resume a stream restored as "
                            f"{list(self.earlier)}: make the stream with earlier= as the saved one had it")
        self.span, self.epoch, self.taken = int(state.get("span", 0)), int(state["epoch"]), int(state["taken"])
        self._placed = True

    def records_per_epoch(self, worker: Optional[int] = None, num_workers: Optional[int] = None) -> int:
        """The records in an epoch of a worker's deal, this worker's by default (text files are counted by
        reading them, once)."""
        w, n = (self.worker, self.num_workers) if worker is None else (worker, num_workers)
        return sum(self._records_of(i) for i in range(w, len(self._all_units), n))

    def batches_per_epoch(self, worker: int, num_workers: int) -> int:
        return -(-self.records_per_epoch(worker, num_workers) // self.batch_size)

    def epoch_records(self) -> Optional[int]:
        """The records of the epoch being read, where the files say it without reading (not text)."""
        w, n = self._deal()
        units = self._all_units[w::n]
        return sum(u.records for u in units) if all(self._exact(u) for u in units) else None

    def seek_batches(self, done: int) -> None:
        """Go to the position after `done` batches from the start of the plan: where a worker that trained that
        many stands (an epoch has ceil(records / batch_size) batches, its last one short)."""
        self._seek(done)
        self._placed = True

    def _seek(self, done: int) -> None:
        for i, span in enumerate(self.plan.spans):
            left = self.batches_per_epoch(span.worker, span.num_workers) - span.first
            if done < left:
                self.span, self.epoch, self.taken = i, span.epoch, (span.first + done) * self.batch_size
                return
            done -= left
        per_epoch = self.batches_per_epoch(self.worker, self.num_workers)
        if per_epoch == 0:
            raise DataError(f"worker {self.worker} of {self.num_workers} has no records in {len(self.units)} units")
        self.span = len(self.plan.spans)
        self.epoch, self.taken = self.plan.first_epoch + done // per_epoch, (done % per_epoch) * self.batch_size

    def _regroup(self, earlier: Sequence[Handover]) -> None:
        """Read the plan these restores make; the position is its start until told otherwise."""
        self.earlier = tuple(earlier)
        self.plan = file_regroup.plan_for(self.worker, self.num_workers, self.earlier, self.batches_per_epoch)
        self._seek(0)

    def _records_of(self, index: int) -> int:
        unit = self._all_units[index]
        if self._exact(unit):
            return unit.records
        if index not in self._unit_records:
            self._unit_records[index] = sum(len(features) for features, _ in self._read(unit, 0))
        return self._unit_records[index]

    def _exact(self, unit: file_units.Unit) -> bool:
        """Whether a unit's size says how many records it gives: known without reading (not text), and no bad
        record can be skipped from it."""
        return unit.records >= 0 and self.on_bad_record == "error"

    def _read(self, unit: file_units.Unit, skip: int) -> Iterator[Tuple[Features, int]]:
        """(Features, bad records skipped) of a unit from record `skip` on."""
        for chunk in file_formats.read_part(unit.path, unit.part, self.layout, skip, self.on_bad_record):
            features, bad = file_formats.to_features(chunk, self.layout, self.names, self.on_bad_record)
            yield features, bad + chunk.bad

    def _deal(self, span: Optional[int] = None) -> Tuple[int, int]:
        """(worker, num_workers) of the deal that span `span` (the current one by default) reads."""
        span = self.span if span is None else span
        if span < len(self.plan.spans):
            s = self.plan.spans[span]
            return s.worker, s.num_workers
        return self.worker, self.num_workers

    # ---- batches
    def __iter__(self) -> Iterator[Batch]:
        """Batches from the position on, epoch after epoch; the last batch of an epoch may be short. A stream
        made with `resume` first goes to where the worker's training stands (a restarted or restored worker)."""
        if self._resume is not None and not self._placed:
            self._go_to(self._resume())
        q: "queue.Queue" = queue.Queue(self.read_ahead)
        stop = threading.Event()
        reader = threading.Thread(target=self._produce, args=(q, stop, self.span, self.epoch, self.taken),
                                  name="towerflow-file-reader", daemon=True)
        reader.start()
        halt = _halting(stop, reader)
        atexit.register(halt)  # a stream left unfinished at exit: its reader stops before the interpreter does
        try:
            while True:
                item = q.get()
                if isinstance(item, BaseException):
                    raise item
                batch, span, epoch, taken, bad = item
                self.span, self.epoch, self.taken = span, epoch, taken
                self.bad_records += bad
                yield batch.as_tuple() if self.as_tuples else batch
        finally:
            atexit.unregister(halt)
            halt()

    def _go_to(self, where: Union[int, Resume]) -> None:
        where = where if isinstance(where, Resume) else Resume(int(where))
        if where.earlier and self.earlier and tuple(where.earlier) != self.earlier:
            raise DataError(f"this stream was made with earlier={list(self.earlier)}, and the training it resumes was "
                            f"restored as {list(where.earlier)}: drop earlier=, the strategy knows it")
        if where.earlier:
            self._regroup(where.earlier)
        if where.batches or self.earlier:
            self.seek_batches(where.batches)

    def _produce(self, q: "queue.Queue", stop: threading.Event, span: int, epoch: int, taken: int) -> None:
        try:
            spans = self.plan.spans
            while not stop.is_set():
                w, n = self._deal(span)
                handed = 0
                for batch, new_taken, bad in self._epoch_batches(self._all_units[w::n], w, epoch, taken):
                    if stop.is_set():
                        return
                    if not _put(q, (batch, span, epoch, new_taken, bad), stop):
                        return
                    handed += 1
                if not handed and taken == 0 and span >= len(spans):
                    raise DataError(f"worker {self.worker} of {self.num_workers} found no records in its "
                                    f"{len(self.units)} units ({self.units[0].path} ...): every line or row was empty "
                                    "or skipped as bad")
                if span < len(spans):  # on to the next span, or to this worker's own deal
                    span += 1
                    epoch, taken = ((spans[span].epoch, spans[span].first * self.batch_size) if span < len(spans)
                                    else (self.plan.first_epoch, 0))
                else:
                    epoch, taken = epoch + 1, 0
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            _put(q, e, stop)

    def _epoch_batches(self, units: Sequence[file_units.Unit], worker: int, epoch: int,
                       taken: int) -> Iterator[Tuple[Batch, int, int]]:
        """Epoch `epoch` of `worker`'s deal `units`, from record `taken` on, shuffled as that worker shuffles it."""
        pending: List[Features] = []
        have, bad_total = 0, 0
        start_window = taken // self.window
        skip = taken - start_window * self.window
        for index, (window, bad) in enumerate(self._windows(units, start_window * self.window), start=start_window):
            bad_total += bad
            if self.shuffle:
                order = torch.randperm(len(window), generator=torch.Generator().manual_seed(
                    hash((self.seed, epoch, index, worker)) & 0x7FFFFFFF))
                window = window.take(order)
            if skip:
                window, skip = window.slice(skip, len(window)), 0
            pending.append(window)
            have += len(window)
            while have >= self.batch_size:
                batch, pending, have = _cut(pending, self.batch_size)
                taken += self.batch_size
                yield batch, taken, bad_total
                bad_total = 0
        if have:
            batch, _, _ = _cut(pending, have)
            yield batch, taken + have, bad_total

    def _windows(self, units: Sequence[file_units.Unit], first: int) -> Iterator[Tuple[Batch, int]]:
        """Windows of `self.window` records from this epoch's record `first` on (with the bad records skipped)."""
        chunks: List[Features] = []
        have, bad_total, to_skip = 0, 0, first
        for unit in units:
            exact = self._exact(unit)
            if exact and unit.records <= to_skip:  # a whole unit before the position: not even opened
                to_skip -= unit.records
                continue
            inside = to_skip if exact else 0  # a row group is sliced; a text file is read and dropped
            to_skip -= inside
            for features, bad in self._read(unit, inside):
                bad_total += bad
                if to_skip:
                    dropped = min(to_skip, len(features))
                    features, to_skip = features.slice(dropped, len(features)), to_skip - dropped
                if len(features) == 0:
                    continue
                chunks.append(features)
                have += len(features)
                while have >= self.window:
                    window, chunks, have = _cut(chunks, self.window)
                    yield window, bad_total
                    bad_total = 0
        if have:
            window, _, _ = _cut(chunks, have)
            yield window, bad_total


def read_all(paths: Union[str, Sequence[str]], format: Optional[str] = None,
             rows_per_table: Optional[Sequence[int]] = None, schema: Optional[Schema] = None) -> Batch:
    """Every record of the files, in order, as one batch: a held-out set (`Features` with a schema, Criteo's
    (dense, cats, labels) with `rows_per_table`)."""
    if schema is not None and not schema.fitted:
        raise DataError("read_all with standardized columns whose mean and std are not fitted: pass the training "
                        "stream's schema (stream.schema), fitted on the training files, so both read alike")
    stream = FileStream(paths, format, 1, rows_per_table, schema=schema)
    chunks = [features for unit in stream._all_units for features, _ in stream._read(unit, 0) if len(features)]
    if not chunks:
        raise DataError(f"no records in {paths!r}")
    whole = Features.cat(chunks)
    return whole.as_tuple() if stream.as_tuples else whole


def _cut(chunks: List[Features], n: int) -> Tuple[Features, List[Features], int]:
    """The first `n` records of `chunks` as one batch, the rest, and how many remain."""
    joined = Features.cat(chunks)
    left = len(joined) - n
    return joined.slice(0, n), ([joined.slice(n, len(joined))] if left else []), left


def _put(q: "queue.Queue", item, stop: threading.Event) -> bool:
    """Put `item` once there is room; False when the stream was stopped first (nobody will take it)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _halting(stop: threading.Event, reader: threading.Thread) -> Callable[[], None]:
    """Stop the reader and wait for it: a daemon thread still inside Arrow's or torch's C++ code when the
    interpreter finalizes aborts the whole process ("terminate called without an active exception")."""
    def halt() -> None:
        stop.set()
        reader.join(30)
    return halt
