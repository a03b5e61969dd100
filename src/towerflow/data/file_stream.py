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

import queue
import threading
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from towerflow.data import file_formats, file_regroup, file_units
from towerflow.data.file_regroup import Handover, Plan, Resume
from towerflow.errors import DataError

Batch = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_DONE = object()


class FileStream:
    """This worker's (dense, cats, labels) batches from Criteo-shaped files; `state_dict()` is its position.

    `earlier`: the restores onto other worker counts that this job went through (oldest first); the
    stream then first reads the old workers' remainders that fall to this worker (`file_regroup.py`)."""

    def __init__(self, paths: Union[str, Sequence[str]], format: Optional[str], batch_size: int, rows_per_table: Sequence[int],
                 worker: int = 0, num_workers: int = 1, shuffle_window: int = 0, seed: int = 0,
                 on_bad_record: str = "error", read_ahead: int = 4,
                 resume: Optional[Callable[[], Union[int, Resume]]] = None, earlier: Sequence[Handover] = ()):
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size!r}: expected a positive number of records per batch")
        if on_bad_record not in ("error", "skip"):
            raise DataError(f"on_bad_record={on_bad_record!r}: expected 'error' or 'skip'")
        if len(rows_per_table) != file_formats.NUM_CATS:
            raise DataError(f"rows_per_table has {len(rows_per_table)} entries: expected {file_formats.NUM_CATS}, "
                            "one per categorical column")
        self.files = file_units.list_files(paths)
        self.format = format or file_units.infer_format(self.files)
        self.batch_size, self.rows_per_table = batch_size, list(rows_per_table)
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
        return sum(u.records for u in units) if all(u.records >= 0 for u in units) else None

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
        if unit.records >= 0:
            return unit.records
        if index not in self._unit_records:
            self._unit_records[index] = sum(b.num_rows for b, _ in file_formats.read_part(
                unit.path, unit.part, self.format, 0, self.on_bad_record))
        return self._unit_records[index]

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
        try:
            while True:
                item = q.get()
                if isinstance(item, BaseException):
                    raise item
                batch, span, epoch, taken, bad = item
                self.span, self.epoch, self.taken = span, epoch, taken
                self.bad_records += bad
                yield batch
        finally:
            stop.set()
            while reader.is_alive():  # unblock a reader waiting for room
                try:
                    q.get_nowait()
                except queue.Empty:
                    reader.join(0.05)

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
                for batch, new_taken, bad in self._epoch_batches(self._all_units[w::n], w, epoch, taken):
                    if stop.is_set():
                        return
                    q.put((batch, span, epoch, new_taken, bad))
                if span < len(spans):  # on to the next span, or to this worker's own deal
                    span += 1
                    epoch, taken = ((spans[span].epoch, spans[span].first * self.batch_size) if span < len(spans)
                                    else (self.plan.first_epoch, 0))
                else:
                    epoch, taken = epoch + 1, 0
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            q.put(e)

    def _epoch_batches(self, units: Sequence[file_units.Unit], worker: int, epoch: int,
                       taken: int) -> Iterator[Tuple[Batch, int, int]]:
        """Epoch `epoch` of `worker`'s deal `units`, from record `taken` on, shuffled as that worker shuffles it."""
        pending: List[Batch] = []
        have, bad_total = 0, 0
        start_window = taken // self.window
        skip = taken - start_window * self.window
        for index, (window, bad) in enumerate(self._windows(units, start_window * self.window), start=start_window):
            bad_total += bad
            if self.shuffle:
                order = torch.randperm(len(window[2]), generator=torch.Generator().manual_seed(
                    hash((self.seed, epoch, index, worker)) & 0x7FFFFFFF))
                window = tuple(t[order] for t in window)
            if skip:
                window, skip = tuple(t[skip:] for t in window), 0
            pending.append(window)
            have += len(window[2])
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
        chunks: List[Batch] = []
        have, bad_total, to_skip = 0, 0, first
        for unit in units:
            if 0 <= unit.records <= to_skip:  # a whole unit before the position: not even opened
                to_skip -= unit.records
                continue
            inside = to_skip if unit.records >= 0 else 0  # a row group is sliced; a text file is read and dropped
            to_skip -= inside
            for record_batch, bad in file_formats.read_part(unit.path, unit.part, self.format, inside, self.on_bad_record):
                bad_total += bad
                if to_skip:
                    dropped = min(to_skip, record_batch.num_rows)
                    record_batch, to_skip = record_batch.slice(dropped), to_skip - dropped
                if record_batch.num_rows == 0:
                    continue
                chunks.append(file_formats.to_tensors(record_batch, self.rows_per_table, unit.path))
                have += record_batch.num_rows
                while have >= self.window:
                    window, chunks, have = _cut(chunks, self.window)
                    yield window, bad_total
                    bad_total = 0
        if have:
            window, _, _ = _cut(chunks, have)
            yield window, bad_total


def read_all(paths: Union[str, Sequence[str]], format: Optional[str], rows_per_table: Sequence[int]) -> Batch:
    """Every record of the files, in order, as one (dense, cats, labels): a held-out set."""
    files = file_units.list_files(paths)
    fmt = format or file_units.infer_format(files)
    chunks = [file_formats.to_tensors(batch, rows_per_table, unit.path)
              for unit in file_units.units_of(files, fmt)
              for batch, _ in file_formats.read_part(unit.path, unit.part, fmt)
              if batch.num_rows]
    return _cut(chunks, sum(len(c[2]) for c in chunks))[0]


def _cut(chunks: List[Batch], n: int) -> Tuple[Batch, List[Batch], int]:
    """The first `n` records of `chunks` as one batch, the rest, and how many remain."""
    joined = tuple(torch.cat([c[i] for c in chunks]) if len(chunks) > 1 else chunks[0][i] for i in range(3))
    head = tuple(t[:n] for t in joined)
    rest = tuple(t[n:] for t in joined)
    left = len(rest[2])
    return head, ([rest] if left else []), left
