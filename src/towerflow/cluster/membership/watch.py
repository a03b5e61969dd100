"""Failure detection in store work that grows as N: a watcher per group, losses published once.

When every task reads every peer's heartbeat, the store serves N reads of N keys per check: its work grows
as N² and, past a few hundred tasks, starves the heartbeats it is meant to judge (docs/scaling.md). Above
`WATCHED_FROM` tasks the cluster's tasks are cut, in cluster order, into groups of about √N. In each group
the first member not published lost is its watcher: every `WATCH_EVERY` s it reads its members' beats and
incarnations in one batched read and, when one has been silent past the limit, publishes the loss. The
other members watch only their watcher, the same way, so a dead watcher is published by its group within
one timeout, and the next member takes over. A task that checks its peers reads one key (`lost/version`)
per check, and the records only when it moved. The limits are the direct check's: the heartbeat timeout,
and the join timeout on top for a task the launcher may still restart; a record names the incarnation
that went silent, so a restarted task is alive again without anyone retracting it.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from towerflow.cluster.membership import numbered as _numbered
from towerflow.devices.spec import DeviceSpec

WATCHED_FROM = 32  # clusters of more tasks are watched by group; smaller ones check each other directly
WATCH_EVERY = 0.5  # seconds between two reads of a watcher's group (and of a member's watcher)
VERSION = "lost/version"  # how many losses were published; a loss's record is at lost/<number>

Beats = Callable[[Sequence[DeviceSpec]], List[Tuple[int, int]]]  # (beat count, incarnation) of each task
BeatKeys = Callable[[Sequence[DeviceSpec]], List[str]]  # the tasks' beat keys, then their incarnation keys


def groups_of(tasks: Sequence[DeviceSpec]) -> List[List[DeviceSpec]]:
    """The tasks cut in cluster order into groups of ceil(√N)."""
    size = max(1, math.ceil(math.sqrt(len(tasks))))
    return [list(tasks[i:i + size]) for i in range(0, len(tasks), size)]


class Watch:
    """One task's part in the group watch: the watching it does (`tick`) and the losses it reads (`lost_among`).

    `limit(incarnation)` is how long a task of that incarnation may be silent; `store_of()` the store now
    (None once the task left the cluster). With `beat_keys`, a tick whose keys all exist (checked once: beat,
    incarnation and version keys are never deleted) reads the loss count and its targets' beats in one
    batched call, instead of three (the count, a check and the batch)."""

    def __init__(self, store_of: Callable[[], object], me: DeviceSpec, tasks: Sequence[DeviceSpec], beats: Beats,
                 limit: Callable[[int], float], clock: Callable[[], float] = time.monotonic,
                 beat_keys: Optional[BeatKeys] = None):
        self._store_of = store_of
        self.me = me
        self.group = next(g for g in groups_of(tasks) if any(_same(t, me) for t in g))
        self._beats = beats
        self._beat_keys = beat_keys
        self._existing: set = set()  # keys a check found: they stay (nothing deletes them)
        self._limit = limit
        self._clock = clock
        self._seen: Dict[Tuple[str, int], Tuple[Tuple[int, int], float]] = {}  # task -> (beat, incarnation), since
        self._read = 0  # the records lost/1 .. lost/<_read> are read
        self._records: Dict[Tuple[str, int], dict] = {}  # the latest record published of each task
        self._lock = threading.Lock()
        self._waking: List[threading.Event] = []  # set when a newly published loss is read (`waking`)

    # --- watching -----------------------------------------------------------------------------

    def tick(self) -> None:
        """Read what this task watches (its group, when it is the watcher; else its watcher) and publish the
        losses found. Called every WATCH_EVERY s by the task's watch thread."""
        store = self._store_of()
        if store is None:
            return
        with self._lock:
            targets, states = self._look(store)
            watched = {(t.job, t.task) for t in targets}
            for key in [k for k in self._seen if k not in watched]:  # no longer watched: a fresh wait when again
                del self._seen[key]
            now = self._clock()
            for t, state in zip(targets, states):
                key = (t.job, t.task)
                last = self._seen.get(key)
                if last is None or last[0] != state:
                    self._seen[key] = (state, now)
                    continue
                silent, incarnation = now - last[1], state[1]
                if silent > self._limit(incarnation) and not self._published(key, incarnation):
                    self._publish(store, t, incarnation, silent)

    def _look(self, store) -> Tuple[List[DeviceSpec], List[Tuple[int, int]]]:
        """The targets and their (beat, incarnation): one batched call with the loss count once all the keys
        are known to exist, else the count, then the targets' beats."""
        targets = self._targets()
        keys = [VERSION, *self._beat_keys(targets)] if self._beat_keys is not None and targets else None
        if keys is not None and (self._existing.issuperset(keys) or store.check(keys)):
            self._existing.update(keys)
            values = [int(v) for v in store.multi_get(keys)]
            self._refresh(store, values[0])
            if self._targets() == targets:  # no watcher of this task's newly published lost in the same read
                n = len(targets)
                return targets, list(zip(values[1:1 + n], values[1 + n:]))
        else:
            self._refresh(store)
        targets = self._targets()
        return targets, self._beats(targets)

    def _targets(self) -> List[DeviceSpec]:
        """The group's members but this task when it watches the group; else its watcher alone."""
        for member in self.group:
            if _same(member, self.me):
                return [m for m in self.group if not _same(m, self.me)]
            if not self._published((member.job, member.task), None):
                return [member]
        return []

    def _published(self, key: Tuple[str, int], incarnation: Optional[int]) -> bool:
        """Whether the loss of the task's `incarnation` (None: the one last seen) is published."""
        record = self._records.get(key)
        if record is None:
            return False
        if incarnation is None:
            seen = self._seen.get(key)
            incarnation = seen[0][1] if seen else record["incarnation"]
        return record["incarnation"] == incarnation

    def _publish(self, store, task: DeviceSpec, incarnation: int, silent: float) -> None:
        record = {"job": task.job, "index": task.task, "incarnation": incarnation, "silent_s": round(silent, 3),
                  "by": f"/job:{self.me.job}/task:{self.me.task}"}
        number = int(store.add(VERSION, 1))
        store.set(f"lost/{number}", json.dumps(record))
        self._records[(task.job, task.task)] = record

    # --- reading ------------------------------------------------------------------------------

    def _refresh(self, store, published: Optional[int] = None) -> None:
        """Read the records published since the last read (`published`: the loss count, if just read): one key
        while none was."""
        if published is None:
            published = int(store.add(VERSION, 0))
        if published <= self._read:
            return
        found = _numbered.read(store, "lost/", range(self._read + 1, published + 1))
        for number in range(self._read + 1, published + 1):
            if number not in found:  # its publisher counted it and has not written it yet: read it next time
                return
            record = json.loads(found[number])
            self._records[(record["job"], record["index"])] = record
            self._read = number
            for event in self._waking:
                event.set()

    @contextlib.contextmanager
    def waking(self, event: threading.Event) -> Iterator[None]:
        """Set `event` whenever a tick reads a newly published loss, for as long as the block runs: a task
        waiting on its peers checks then instead of at its next check (up to a second later)."""
        with self._lock:
            self._waking.append(event)
        try:
            yield
        finally:
            with self._lock:
                self._waking.remove(event)

    def lost_among(self, tasks: Sequence[DeviceSpec], incarnation_of: Callable[[str, int], int]) -> List[dict]:
        """The published losses of `tasks` whose lost incarnation is still the current one."""
        store = self._store_of()
        if store is None:
            return []
        with self._lock:
            self._refresh(store)
            candidates = [(t, self._records[(t.job, t.task)]) for t in tasks if (t.job, t.task) in self._records]
        return [record for t, record in candidates if incarnation_of(t.job, t.task) == record["incarnation"]]


def _same(a: DeviceSpec, b: DeviceSpec) -> bool:
    return (a.job, a.task) == (b.job, b.task)
