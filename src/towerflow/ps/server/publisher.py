"""A ps task's rows published while training runs: a snapshot, then every few seconds the rows changed since.

`towerflow launch --publish-every S` makes every ps task run a `Publisher`: a daemon thread that, every S
seconds, writes for each model it serves a numbered publication to its `DeltaLog` (`ps/tables/delta_log.py`)
or another sink with the same `write`: the first one after it starts (or after the part was restored) a full
snapshot, the others a delta of the rows changed since the previous publication (and the ids of hash rows evicted since); the dense shards go whole
every time.

A sink whose store keeps only each row's newest value (Redis: `periodic_snapshots = False`) gets no other
snapshot: re-writing every row would change nothing there. A log of files (`periodic_snapshots = True`) gets
one more whenever the deltas since its last snapshot hold as many rows as a snapshot would (`snapshot_every`
None, the default): a reader catching up then reads at most about two snapshots' worth, and a log that keeps
its newest snapshots and the deltas after them stays within a few snapshots on disk, whatever the period.
`snapshot_every=K` writes one after every K deltas instead.

Training is held only while the changed keys are taken and the dense shards copied (under the service's
lock: a swap and a small copy). The thread runs at a lower priority (`niceness`, Linux): on a host whose cores
the training fills, a snapshot's gigabytes are written with the cycles training leaves, not taken from it. The rows themselves are read after the lock is released, in chunks: a row
a push changes meanwhile is marked again and goes out with the next publication, so the last publication
after training stops holds every row exactly as the ps does.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from towerflow import _log
from towerflow.errors import ParameterServerError
from towerflow.redis_url import is_redis_url, parse_redis_url
from towerflow.ps.replication_messages import is_part_key
from towerflow.ps.tables import row_files
from towerflow.ps.tables.delta_log import DELTA, SNAPSHOT, DeltaLog, Publication
from towerflow.ps.tables.row_changes import RowChanges


@dataclasses.dataclass
class _Followed:
    """What the publisher knows of one served model: the service it tracks and when it last wrote a snapshot."""

    service: object
    changes: Optional[RowChanges] = None
    loads: int = 0
    since: Optional[int] = None  # deltas since the last snapshot (None: none written yet)
    rows_since: int = 0  # the rows those deltas hold


class Publisher:
    """Publishes every served model's rows every `every` seconds through `sink(model)` (one sink per model)."""

    def __init__(self, services: Callable[[], Dict[str, object]], sink: Callable[[str], object], every: float,
                 snapshot_every: Optional[int] = None, chunk_rows: int = row_files.CHUNK_ROWS, task: Optional[str] = None,
                 niceness: int = 10):
        self.services = services
        self.log = _log.get("ps", task)
        self.sink = sink
        self.every = float(every)
        if snapshot_every is not None and not (isinstance(snapshot_every, int) and snapshot_every >= 1):
            raise ParameterServerError(f"snapshot_every={snapshot_every!r}: expected None (a snapshot once the deltas "
                                       "since the last hold as many rows) or a whole number of deltas >= 1")
        self.snapshot_every = snapshot_every
        self.chunk_rows = chunk_rows
        self.niceness = niceness
        self._followed: Dict[str, _Followed] = {}
        self._sinks: Dict[str, object] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Publisher":
        self._thread = threading.Thread(target=self._run, name="towerflow-publisher", daemon=True)
        self._thread.start()
        return self

    def stop(self, final: bool = True) -> None:
        """Stop the thread; `final`: publish once more (the rows of the last steps)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if final:
            self.publish(final=True)

    def _run(self) -> None:
        try:  # this thread only (Linux gives each thread its own nice value)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.niceness)
        except (AttributeError, OSError):
            pass
        while not self._stop.wait(self.every):
            try:
                self.publish()
            except Exception:  # a full disk must not end training: say so and try again next time
                self.log.exception("publishing the ps rows failed; trying again in %.0f s", self.every)

    def publish(self, final: bool = False) -> List[Publication]:
        """One publication per served model, now; `final`: a delta even when a snapshot is due (a ps task
        stopping must not start writing gigabytes: the launcher stops a ps task 5 s after the workers end)."""
        out = []
        served = {model: followed.service for model, followed in self._followed.items()}  # also once shut down
        served.update(self.services())
        for model, service in served.items():
            if is_part_key(model):  # a lost task's part this backup serves while promoted: that task publishes it
                continue
            out.append(self._publish(model, service, final))
        return out

    def _publish(self, model: str, service, final: bool = False) -> Publication:
        followed = self._followed.get(model)
        if followed is None or followed.service is not service:
            followed = self._followed[model] = _Followed(service)
        tables = service.tables
        sink = self._sinks.get(model)
        if sink is None:
            sink = self._sinks[model] = self.sink(model)
        with service.lock:
            if tables and followed.changes is None:
                followed.changes = tables.track_changes()
            restored = bool(tables) and tables.loads != followed.loads
            due = sink.periodic_snapshots and not final and followed.since is not None and self._snapshot_due(
                followed, tables.rows_held if tables else 0)
            full = followed.since is None or restored or due
            step = service.coordinator.global_step
            dense = _dense_copy(service)
            taken: Dict[str, Tuple[str, object]] = {}
            evicted: Dict[str, torch.Tensor] = {}
            for name, spec in (tables.specs.items() if tables else ()):
                keys = followed.changes.take(name)  # a snapshot starts the record over too
                if spec.is_hash:  # its rows move as ids are admitted and evicted: copied here, under the lock
                    ids, values = (tables.stores[name].export()[:2] if full else tables.rows_now(name, keys))
                    taken[name] = ("rows", (ids, values))
                    gone = followed.changes.take_evicted(name)
                    if not full and gone.numel():  # those admitted again since are in `ids`, with their new rows
                        gone = gone[~torch.isin(gone, tables.rows_now(name, gone)[0])]
                        if gone.numel():
                            evicted[name] = gone
                else:
                    taken[name] = ("keys", None if full else keys)
            why = ("its first, or the last one failed" if followed.since is None else "its part was restored" if restored else
                   f"{followed.since} deltas of {followed.rows_since} rows since the last")
            followed.loads = tables.loads if tables else 0
        kind = SNAPSHOT if full else DELTA
        try:
            entry = sink.write(kind, step, time.time(), self._table_chunks(tables, taken), dense, evicted)
        except BaseException:
            followed.since = None  # the rows taken are in no publication: the next one must be a snapshot
            raise
        followed.since = 0 if full else followed.since + 1
        followed.rows_since = 0 if full else (followed.rows_since + sum(entry.rows.values())
                                              + sum(entry.evicted_rows.values()))
        if full:
            self.log.info(f"published snapshot {entry.seq} of {model!r} at global step {step} ({why})")
        return entry

    def _snapshot_due(self, followed: _Followed, snapshot_rows: int) -> bool:
        """Whether a log of files should get a snapshot now rather than a delta (`snapshot_every`)."""
        if self.snapshot_every is not None:
            return followed.since >= self.snapshot_every
        return followed.rows_since >= max(snapshot_rows, 1)

    def _table_chunks(self, tables, taken) -> Iterator[Tuple[str, int, Iterator]]:
        for name, (what, value) in taken.items():
            spec = tables.specs[name]
            if what == "rows":
                yield name, spec.dim, row_files.chunked(value[0], value[1], self.chunk_rows)
            elif value is None:
                yield name, spec.dim, _whole_shard(tables, name, self.chunk_rows)
            else:
                yield name, spec.dim, _changed_rows(tables, name, value, self.chunk_rows)


def _dense_copy(service) -> Dict[str, torch.Tensor]:
    """This task's dense shards by name, copied (they are small: the tables are not among them)."""
    out = {}
    for sp in service.shards:
        flat = service.flats[service.dtypes.index(sp.dtype)]
        out[sp.name] = flat[sp.offset:sp.offset + sp.numel].view(sp.shape).clone()
    return out


def _whole_shard(tables, name: str, chunk_rows: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    values = tables.fixed_values(name)
    spec, shard = tables.specs[name], tables.task
    for start in range(0, values.shape[0], chunk_rows):
        local = torch.arange(start, min(values.shape[0], start + chunk_rows), dtype=torch.int64)
        yield spec.global_ids(shard, local), values[start:start + chunk_rows].clone()


def _changed_rows(tables, name: str, keys: torch.Tensor, chunk_rows: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    for start in range(0, keys.numel(), chunk_rows):
        yield tables.rows_now(name, keys[start:start + chunk_rows])


def sink_for(target: str, task: int) -> Callable[[str], object]:
    """Each model's sink for `--publish-to`: a folder (`DeltaLog`) or redis://HOST:PORT/DB (`RedisSink`)."""
    if is_redis_url(target):
        from towerflow.ps.server.redis_sink import RedisSink

        parse_redis_url(target)
        return lambda model: RedisSink(target, model, task)
    return lambda model: DeltaLog(target, model, task)
