"""The end of a cluster's work, decided once in the store, so that a restarted task never rejoins
a cluster that is leaving.

Every task says it is done (`Server.join`: a worker at the end of its script, a ps as soon as it
serves) and all leave once every task is. The launcher restarts a task killed after it said so
too, and its new incarnation must not rejoin while the others leave: it would call ps tasks that
are closing and fail every restart. Two store operations keep the end and a rejoin apart:

* a task that sees every task done reads END_KEY, checks the done keys again, and sets END_KEY to
  ENDED only if it still holds what it read (compare-and-set);
* a restarted incarnation whose earlier one was done first deletes that done key, then moves
  END_KEY to a fresh value (compare-and-set), unless it reads ENDED.

Whichever comes second sees the other. Either the end's compare-and-set fails and the others wait
until the new incarnation is done again (it rejoins; a worker that had finished learns so from
the ps and trains no more), or the new incarnation finds the cluster ENDED, puts the done key
back and has nothing to rejoin: its part of the work was over before it was killed.

A store in etcd outlives the run's processes by only its lease (etcd_store.py): a task restarted later
than that (its host cut off across the job's end) would find no trace of its run and wait for the
others as at a first start. So every task records, beside the run's keys and beyond its lease, which
run its launcher's tasks joined (`remember_run`, by the launcher's id), and each task that sees the end
records that run's end (`record_end`): such a restart learns that its run ended and exits 0.
"""

from __future__ import annotations

import json
import time
from typing import Collection, List, Optional, Sequence, Tuple

from towerflow import _log
from towerflow.cluster.membership import failures as _failures
from towerflow.cluster.membership import numbered as _numbered
from towerflow.cluster.store import stores as _stores
from towerflow.cluster.calls import endpoint as _calls
from towerflow.cluster.store.c10d import Store

END_KEY = "cluster/end"  # "" or a rejoin's mark while the cluster runs, ENDED once its work is over
ENDED = "ended"
_MARKS = "cluster/rejoin_marks"  # a counter: each rejoin's mark is unique, so no two compare-and-sets pass as one
DONE_VERSION = "cluster/done_version"  # bumped after every change to a done or stand-in key (see done_version)
CHANGE = "cluster/done_change/"  # + n: which key the n-th change set or deleted (see count_change)
UNRECORDED_PATIENCE = 2.0  # s a counted change may stay unrecorded before a reader reads every task's keys


def done_version(store: Store) -> int:
    """The number of changes to the tasks' done keys so far. Each change bumps it *after* the key
    changed, so a reader that read the version before it last read the done keys, and reads the same
    version now, knows they are unchanged (membership.py reads them again only then: one store call
    per check instead of one per task; docs/scaling.md)."""
    return int(store.add(DONE_VERSION, 0))


def mark_done(rendezvous) -> None:
    """Say in the store that this task is done (`Server.join`)."""
    rendezvous.mark("done")
    count_change(rendezvous.store, rendezvous.key("done"), True)


def count_change(store: Store, key: str, is_set: bool) -> None:
    """Bump the done version after a done key (or a stand-in key: membership.py) was set or deleted, and record
    which one under the new number: a reader then reads the changes since its last read in one call instead of
    every task's keys again (which, as each of N tasks says it is done at the end of a run, made every one of N
    waiting tasks read 2N keys one call at a time: N³ calls)."""
    number = int(store.add(DONE_VERSION, 1))
    store.set(f"{CHANGE}{number}", json.dumps([key, is_set]))


def changes(store: Store, after: int, upto: int) -> List[Tuple[str, bool]]:
    """The changes numbered after+1 .. upto, in order, as (key, set or deleted), up to the first one counted and not
    recorded yet (its task is between the two calls of count_change, or died there): fewer than upto - after then."""
    numbers = range(after + 1, upto + 1)
    found = _numbered.read(store, CHANGE, numbers)
    recorded = []
    for n in numbers:
        if n not in found:
            break
        key, is_set = json.loads(found[n])
        recorded.append((key, bool(is_set)))
    return recorded


class MarkedTasks:
    """The tasks done, and those another task stands in for, as one task reads them from the change log.

    One store call while no done or stand-in key has changed since the last read (done_version counts changes to
    both), else three (the changes since, in one batch). A change counted and not recorded yet is read at a later
    call (its writer records it next); every task's keys are read one by one only when it stays unrecorded for
    UNRECORDED_PATIENCE s (its writer died between the two calls): every task reading every task's keys at once
    is N² calls."""

    def __init__(self):
        self._version = -1  # the version the sets below stand for
        self._done: frozenset = frozenset()
        self._stood_in: frozenset = frozenset()
        self._unrecorded: Optional[Tuple[int, float]] = None  # a change counted and not recorded: its number, since

    def read(self, rendezvous) -> Tuple[frozenset, frozenset]:
        """(job, index) of the tasks done, and of those stood in for, in `rendezvous`' store."""
        store = rendezvous.store
        version = done_version(store)
        if version == self._version:
            return self._done, self._stood_in
        start = max(self._version, 0)
        found = changes(store, start, version)
        upto = start + len(found)
        if upto == version:
            self._unrecorded = None
        elif self._unrecorded is None or self._unrecorded[0] != upto + 1:
            self._unrecorded = (upto + 1, time.monotonic())
        elif time.monotonic() - self._unrecorded[1] >= UNRECORDED_PATIENCE:
            self._unrecorded = None
            tasks = rendezvous.cluster.tasks()
            self._version = version
            self._done, self._stood_in = (frozenset((t.job, t.task) for t in tasks if rendezvous.is_marked(kind, t.job, t.task))
                                          for kind in ("done", "stood_in"))
            return self._done, self._stood_in
        sets = {"done": set(self._done), "stood_in": set(self._stood_in)}
        for key, is_set in found:
            kind, task = key.split("/", 1)
            job, index = task.rsplit("/", 1)
            if kind in sets:
                (sets[kind].add if is_set else sets[kind].discard)((job, int(index)))
        self._version, self._done, self._stood_in = upto, frozenset(sets["done"]), frozenset(sets["stood_in"])
        return self._done, self._stood_in


def _read(store: Store) -> str:
    return store.get(END_KEY).decode() if store.check([END_KEY]) else ""


def has_ended(store: Store) -> bool:
    """Whether every task had said it was done and the cluster is leaving (or has left)."""
    return _read(store) == ENDED


def try_end(store: Store, done_keys: Sequence[str]) -> bool:
    """Mark the cluster ended when every task is done; False when one is not, or took its done back
    (a restarted incarnation) while this check ran."""
    seen = _read(store)
    if seen == ENDED:
        return True
    if done_keys and not store.check(list(done_keys)):  # one call: all of them set
        return False
    return store.compare_set(END_KEY, seen, ENDED).decode() == ENDED


def take_back_done(store: Store, done_key: str) -> bool:
    """A restarted incarnation: make the cluster wait for it again if its earlier incarnation had said
    it was done. Returns False, leaving the done key in place, when the cluster has already ended."""
    if not store.check([done_key]):
        return True  # it died before it was done: the cluster cannot end without this task
    store.delete_key(done_key)
    count_change(store, done_key, False)
    mark = f"rejoin {store.add(_MARKS, 1)}"
    while True:
        seen = _read(store)
        if seen == ENDED:
            store.set(done_key, "1")
            count_change(store, done_key, True)
            return False
        if store.compare_set(END_KEY, seen, mark).decode() == mark:
            return True


def leave_together(rendezvous, wait_s: float = 10.0, absent: Collection[Tuple[str, int]] = ()) -> None:
    """The barrier before closing this task's endpoint, once the cluster has ended (see
    calls/endpoint.py, stop_endpoint): no task closes while another may still wait on a reply of its. A task that never
    comes (it died after finishing) only costs the wait; one known `absent` (another task stands in for it:
    membership.stand_in) is not waited for."""
    rendezvous.mark("leaving")
    rendezvous.wait_for_others("leaving", wait_s, absent)


def leave(rendezvous, graceful: bool, absent: Collection[Tuple[str, int]] = ()) -> None:
    """Stop serving and calling, and let go of the store: `graceful` once the cluster has ended (together
    with the others but those `absent`, and the task that hosts the store last), else at once (a failure)."""
    try:
        if graceful:
            _calls.stop_endpoint(graceful=True, everyone_leaving=lambda: leave_together(rendezvous, absent=absent))
            rendezvous.mark("left")
            if rendezvous.hosts_store:  # the store must outlive everyone's leave
                rendezvous.wait_for_others("left", 30.0, absent)
        else:
            _calls.stop_endpoint(graceful=False)
    except Exception:
        if _calls.is_endpoint_running():
            _calls.stop_endpoint(graceful=False)
    finally:
        _failures.detach(rendezvous.store)
        rendezvous.close()


def rejoin_or_exit(rendezvous) -> None:
    """Server.start of a restarted incarnation, once its rendezvous holds the slot: take the earlier
    incarnation's done back (the cluster then waits for this one), or, when the cluster has already
    ended, say so and exit 0 (SystemExit): this task's part of the work was over before it was killed."""
    if rendezvous.incarnation == 0 or take_back_done(rendezvous.store, rendezvous.key("done")):
        return
    for kind in ("leaving", "left"):  # the others' leave need not wait for this task
        rendezvous.mark(kind)
    _log.get("cluster", rendezvous.name).info(
        f"(restart {rendezvous.incarnation}) has nothing to rejoin: it had finished before it was killed, and so "
        "had every other task; the cluster has ended. Exiting with 0.")
    raise SystemExit(0)


def remember_run(rendezvous) -> None:
    """Record, beyond the run's lease, that this task's launcher joined the run the store holds now (etcd only)."""
    if rendezvous.records is not None and rendezvous.launch_id:
        rendezvous.records.remember(f"launch/{rendezvous.launch_id}", rendezvous.nonce)


def record_end(rendezvous) -> None:
    """Record, beyond the run's lease, that the run has ended (etcd only). The work is over whatever becomes of the
    record: a store that fails here is said, not raised (every other task that saw the end records it too)."""
    if rendezvous.records is None or not rendezvous.nonce:
        return
    try:
        rendezvous.records.remember(f"ended/{rendezvous.nonce}", repr(time.time()))
    except Exception as e:
        _log.get("cluster", rendezvous.name).warning(
            f"the cluster's run has ended, but recording so beyond the store's lease failed ({e}); a task restarted "
            "later than that would wait for the others as at a first start.")


def exit_if_run_ended(rendezvous) -> None:
    """A restarted incarnation, before it joins: when the run its launcher's tasks joined is no longer the one in
    the store (its keys expired) and that run had ended, say so and exit 0 (SystemExit); when it had not ended,
    say so and go on joining whatever run the store holds, as at a first start."""
    if rendezvous.incarnation == 0 or rendezvous.records is None or not rendezvous.launch_id:
        return
    run = rendezvous.records.recall(f"launch/{rendezvous.launch_id}")
    if run is None:
        return  # no incarnation of this launcher's tasks joined a run yet
    now = _stores.read_publisher(rendezvous.store)
    if now is not None and now["nonce"] == run:
        return  # its run goes on (or is leaving: rejoin_or_exit decides once the slot is held)
    log, restart = _log.get("cluster", rendezvous.name), f"(restart {rendezvous.incarnation})"
    ended = rendezvous.records.recall(f"ended/{run}")
    if ended is not None:
        ago = max(0.0, time.time() - float(ended))
        log.info(f"{restart} has nothing to rejoin: its cluster's run ended {ago:.0f} s ago, while this task was "
                 "away, and its keys have left the store since. Exiting with 0.")
        raise SystemExit(0)
    log.info(f"{restart}: the run it belonged to is gone from the store without an end (every task of it was "
             "away for longer than the store keeps a run's keys); it joins "
             + ("the run the store holds now." if now is not None else "as at a first start, waiting for the others."))
