"""One worker's batches from files: its units in order, shuffled in bounded windows, read ahead by a thread.

Shuffling is by window: the worker's records of an epoch are cut into windows of `shuffle_window`
records, and each window is permuted by a seed of (seed, epoch, window). A position is then two
numbers, the epoch and the records handed out in it: resuming re-reads the current window from its
first record (no buffer is saved) and skips what was handed out, so no record is trained on twice
and none is skipped. Memory holds one window and the read-ahead queue, whatever the data's size.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from towerflow.data import file_formats, file_units
from towerflow.errors import DataError

Batch = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_DONE = object()


class FileStream:
    """This worker's (dense, cats, labels) batches from Criteo-shaped files; `state_dict()` is its position."""

    def __init__(self, paths: Union[str, Sequence[str]], format: Optional[str], batch_size: int, rows_per_table: Sequence[int],
                 worker: int = 0, num_workers: int = 1, shuffle_window: int = 0, seed: int = 0,
                 on_bad_record: str = "error", read_ahead: int = 4, resume: Optional[Callable[[], int]] = None):
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
        self.units = file_units.assign(file_units.units_of(self.files, self.format), worker, num_workers)
        self.worker, self.num_workers = worker, num_workers
        self.window = max(shuffle_window, batch_size)
        self.shuffle = shuffle_window > 0
        self.seed, self.on_bad_record, self.read_ahead = seed, on_bad_record, read_ahead
        self.epoch, self.taken = 0, 0  # the position: records handed out in this epoch
        self.bad_records = 0
        self._resume = resume  # batches already trained when iteration starts (a restarted worker's, asked then)
        self._records: Optional[int] = None

    # ---- the position
    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "taken": self.taken, "worker": self.worker, "num_workers": self.num_workers}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if (state.get("worker"), state.get("num_workers")) != (self.worker, self.num_workers):
            raise DataError(f"a position of worker {state.get('worker')} of {state.get('num_workers')} cannot resume "
                            f"worker {self.worker} of {self.num_workers}: the files are dealt to the workers anew then")
        self.epoch, self.taken = int(state["epoch"]), int(state["taken"])

    def records_per_epoch(self) -> int:
        """This worker's records in an epoch (text files are counted by reading them, once)."""
        if self._records is None:
            if all(u.records >= 0 for u in self.units):
                self._records = sum(u.records for u in self.units)
            else:
                self._records = sum(b.num_rows for u in self.units
                                    for b, _ in file_formats.read_part(u.path, u.part, self.format, 0, self.on_bad_record))
        return self._records

    def seek_batches(self, done: int) -> None:
        """Go to the position after `done` batches from the start of training: where a worker that trained that
        many stands (an epoch has ceil(records / batch_size) batches, its last one short)."""
        records = self.records_per_epoch()
        per_epoch = -(-records // self.batch_size)
        if per_epoch == 0:
            raise DataError(f"worker {self.worker} of {self.num_workers} has no records in {len(self.units)} units")
        self.epoch, self.taken = done // per_epoch, (done % per_epoch) * self.batch_size

    # ---- batches
    def __iter__(self) -> Iterator[Batch]:
        """Batches from the position on, epoch after epoch; the last batch of an epoch may be short. A stream
        made with `resume` first goes to where the worker's training stands (a restarted or restored worker)."""
        if self._resume is not None and (self.epoch, self.taken) == (0, 0):
            done = self._resume()
            if done:
                self.seek_batches(done)
        q: "queue.Queue" = queue.Queue(self.read_ahead)
        stop = threading.Event()
        reader = threading.Thread(target=self._produce, args=(q, stop, self.epoch, self.taken),
                                  name="towerflow-file-reader", daemon=True)
        reader.start()
        try:
            while True:
                item = q.get()
                if isinstance(item, BaseException):
                    raise item
                batch, epoch, taken, bad = item
                self.epoch, self.taken = epoch, taken
                self.bad_records += bad
                yield batch
        finally:
            stop.set()
            while reader.is_alive():  # unblock a reader waiting for room
                try:
                    q.get_nowait()
                except queue.Empty:
                    reader.join(0.05)

    def _produce(self, q: "queue.Queue", stop: threading.Event, epoch: int, taken: int) -> None:
        try:
            while not stop.is_set():
                for batch, new_taken, bad in self._epoch_batches(epoch, taken):
                    if stop.is_set():
                        return
                    q.put((batch, epoch, new_taken, bad))
                epoch, taken = epoch + 1, 0
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            q.put(e)

    def _epoch_batches(self, epoch: int, taken: int) -> Iterator[Tuple[Batch, int, int]]:
        pending: List[Batch] = []
        have, bad_total = 0, 0
        start_window = taken // self.window
        skip = taken - start_window * self.window
        for index, (window, bad) in enumerate(self._windows(start_window * self.window), start=start_window):
            bad_total += bad
            if self.shuffle:
                order = torch.randperm(len(window[2]), generator=torch.Generator().manual_seed(
                    hash((self.seed, epoch, index, self.worker)) & 0x7FFFFFFF))
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

    def _windows(self, first: int) -> Iterator[Tuple[Batch, int]]:
        """Windows of `self.window` records from this epoch's record `first` on (with the bad records skipped)."""
        chunks: List[Batch] = []
        have, bad_total, to_skip = 0, 0, first
        for unit in self.units:
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
