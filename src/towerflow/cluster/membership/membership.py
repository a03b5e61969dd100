"""Membership: which tasks of a cluster are alive, and which incarnation of each.

Every task beats a counter in the rendezvous store; a task that stops beating without saying it
is done was killed or hangs, and the others fail naming it instead of waiting forever. The
launcher may restart a lost task (`--max-restarts`): its new incarnation serves calls under a new
name (`call_name`) and writes its number in the store, so the others give a task that may come
back the join timeout on top of the heartbeat timeout, and find the new name there. A recorded
failure is final only when no restart is left (`final_failure`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from towerflow._waiting import wait_until
from towerflow.cluster.membership import ending as _ending
from towerflow import taskenv as _taskenv
from towerflow.cluster.membership import failures as _failures
from towerflow.cluster.membership import watch as _watch
from towerflow.cluster.calls import endpoint as _calls
from towerflow.cluster.calls.names import call_name, task_of
from towerflow.cluster.membership.rendezvous import BEAT_EVERY, POLL, Rendezvous, task_name
from towerflow.devices.spec import DeviceSpec
from towerflow.errors import ClusterLeftError, ClusterTimeoutError, PeerLost

ALIVE_BEATS = 3  # beats of a lost incarnation that show it lives on (`wait_for_restart(alive_ok=True)`)


class Membership:
    """The liveness rules of one task towards the others, read from the store of its `rendezvous`
    (which hosts or joins the store at start, hence a reference rather than the store itself)."""

    def __init__(self, rendezvous: Rendezvous, *, heartbeat_timeout: float, join_timeout: float, max_restarts: int):
        self.rendezvous = rendezvous
        self.cluster = rendezvous.cluster
        self.name = rendezvous.name
        self.heartbeat_timeout = heartbeat_timeout
        self.join_timeout = join_timeout  # the time a restarted task has to come back
        self.max_restarts = max_restarts  # a silent task may come back while below this
        self._incarnations: Dict[tuple, int] = {}  # the last one seen of each task, for call_name_of
        self._beating = threading.Event()
        self._beat_thread: Optional[threading.Thread] = None
        self._watch_thread: Optional[threading.Thread] = None
        tasks = self.cluster.tasks()  # a large cluster is watched by group (watch.py), a small one directly
        self.watch = _watch.Watch(lambda: self._store, DeviceSpec(job=rendezvous.job, replica=0, task=rendezvous.index),
                                  tasks, self.beats_of, self._silence_limit, beat_keys=self.beat_keys_of
                                  ) if len(tasks) > _watch.WATCHED_FROM else None
        self._marked = _ending.MarkedTasks()  # the tasks done and those stood in for, read as they change
        self._recorded = _failures.RecordedTasks()  # the tasks that recorded a failure, read as they come

    @property
    def _store(self):
        return self.rendezvous.store

    # --- incarnations ------------------------------------------------------------------------

    def join_calls(self, host: str, security, heartbeat_timeout: float) -> List[str]:
        """Serve remote calls as this incarnation, say in the store that it is up, and start beating.
        Returns the call names of the dead earlier incarnations it replaces (nothing to undo for them:
        a call to one of them fails, and callers look up the current one)."""
        rv = self.rendezvous
        me = call_name(rv.job, rv.index, rv.incarnation)
        _calls.start_endpoint(self._store, me, host, security, heartbeat_timeout)
        self._store.add(rv.key("beat"), 1)  # a first beat before the new incarnation shows (see check_heartbeats)
        self._store.set(rv.key("incarnation"), str(rv.incarnation))
        if rv.incarnation > 0:
            self.stand_in(rv.job, rv.index, None)  # back: watched again (what stood in for it hands its work back)
        rv.mark("up")
        self._start_heartbeat()
        return [call_name(rv.job, rv.index, k) for k in range(rv.incarnation)]

    def incarnation_of(self, job: str, index: int) -> int:
        """How many times the task has been restarted, as its current incarnation wrote in the store."""
        key = self.rendezvous.key("incarnation", job, index)
        return int(self._store.get(key).decode()) if self._store.check([key]) else 0

    def call_name_of(self, job: str, index: int) -> str:
        """The call name of a task's current incarnation (the last one seen once the store is gone)."""
        if self._store is not None:
            self._incarnations[(job, index)] = self.incarnation_of(job, index)
        return call_name(job, index, self._incarnations.get((job, index), 0))

    def final_failure(self, job: str, index: int):
        """The task's recorded failure, unless the launcher will restart it (restarts left): then it
        is a lost task like a killed one, and the heartbeat rules wait for its next incarnation."""
        failed = _failures.failure_of(self._store, job, index)
        if failed is None or self.incarnation_of(job, index) < self.max_restarts:
            return None
        return failed

    def wait_for_restart(self, job: str, index: int, lost: str, cause: str, timeout: Optional[float] = None,
                         alive_ok: bool = False, beats_before: Optional[int] = None) -> str:
        """Wait until task (job, index), whose incarnation named `lost` is gone, has been restarted
        and joined again; returns the new incarnation's call name.

        `alive_ok`: return `lost` itself when that incarnation goes on beating (ALIVE_BEATS beats since the
        wait began, or since the caller read `beats_before` with `beat_count`: a new incarnation beats once before it
        names itself, a dead one at most once more): it lives, only a connection to it was lost (cut off, or a
        stall), and the caller connects again.
        Raises PeerLost at once when the launcher will not restart it (no restarts left: a job that
        allows none ends on a lost connection as on a lost task), and ClusterTimeoutError when it is not
        back within `timeout` (default: heartbeat + join timeouts, and no limit while another task that lives stands in
        for it: `_stand_in_gone`).
        """
        name = task_name(job, index)
        limit = self.heartbeat_timeout + self.join_timeout if timeout is None else timeout
        started = time.monotonic()
        deadline = started + limit
        beats = beats_before if beats_before is not None else self.beat_count(job, index) if alive_ok else 0
        while True:
            if self._store is None:  # a thread of this task still waits as it leaves (a ps's watch for its backup)
                raise ClusterLeftError(f"{self.name} has left the cluster: it waits for {name} no more")
            current = self.call_name_of(job, index)
            if current != lost:
                return current
            incarnation = self._incarnations[(job, index)]
            if alive_ok and incarnation < self.max_restarts and self.beat_count(job, index) - beats >= ALIVE_BEATS:
                return lost
            if incarnation >= self.max_restarts:
                failed = _failures.failure_of(self._store, job, index)
                if failed is not None:  # it stopped on an error: that is the news
                    raise PeerLost(f"{self.name} lost {name}, which {failed.summary}", task=name)
                raise PeerLost(
                    f"{self.name} lost {name} ({cause}), and it will not be restarted ({incarnation} of "
                    f"{self.max_restarts} restarts used). Launch with --max-restarts N: the launcher then restarts a "
                    "lost task and training goes on.",
                    task=name,
                )
            now = time.monotonic()
            if now > deadline and timeout is None:
                stand_in, gone = self._stand_in_gone(job, index)
                if stand_in is not None and gone is None:
                    deadline = now + limit  # its work goes on elsewhere: waited for as long as that task lives
                elif stand_in is not None:
                    its_name = task_name(*task_of(stand_in))
                    raise ClusterTimeoutError(
                        f"{self.name} lost {name} ({cause}) and waited {now - started:.1f} s for it to come back, but "
                        f"{its_name}, which stood in for it as {stand_in}, is gone too ({gone}): no "
                        f"task does {name}'s work now. Is the launcher of its host still running? Else restart the job from "
                        "its newest checkpoint, with a higher --max-restarts if the restarts ran out.",
                        task=self.name,
                        missing=[name, its_name],
                    )
            if now > deadline:
                raise ClusterTimeoutError(
                    f"{self.name} lost {name} ({cause}) and it was not back within {limit:g} s "
                    f"({_taskenv.ENV_HEARTBEAT_TIMEOUT} + {_taskenv.ENV_JOIN_TIMEOUT}); is the launcher of its host still running?",
                    task=self.name,
                    missing=[name],
                )
            time.sleep(POLL)

    def _stand_in_gone(self, job: str, index: int) -> Tuple[Optional[str], Optional[str]]:
        """The call name of the task that stands in for task (job, index) (None: none does), and why it is gone too
        (None while it lives): restarted since (a new incarnation serves nothing of the lost task's), failed, or not
        beating on (`beats_on` within the heartbeat timeout: a process killed right after a beat beats no more, so
        it is told at this look, not the next). Asked once per wait timeout; a stand-in that lives answers in a
        few beats."""
        stand_in = self.stood_in_by(job, index)
        if stand_in is None:
            return None, None
        its_job, its_index = task_of(stand_in)
        current = self.call_name_of(its_job, its_index)
        if current != stand_in:
            return stand_in, f"it was restarted as {current}"
        failed = _failures.failure_of(self._store, its_job, its_index)
        if failed is not None:
            return stand_in, failed.summary
        within = max(self.heartbeat_timeout, (ALIVE_BEATS + 1) * BEAT_EVERY)  # room for the beats, however short the timeout
        if not self.beats_on(its_job, its_index, within):
            return stand_in, f"fewer than {ALIVE_BEATS} heartbeats in {within:g} s"
        return stand_in, None

    def will_be_restarted(self, job: str, index: int) -> bool:
        """Whether the launcher may still restart task (job, index): its current incarnation has restarts left."""
        return self.incarnation_of(job, index) < self.max_restarts

    def beats_on(self, job: str, index: int, within: float) -> bool:
        """Whether task (job, index) beats on (ALIVE_BEATS beats within `within` seconds): it lives, only a
        connection to it was lost. False once `within` has passed without them: it is gone (a dead process
        beats at most once more)."""
        first = self.beat_count(job, index)
        return wait_until(lambda: self.beat_count(job, index) - first >= ALIVE_BEATS, within,
                          f"{ALIVE_BEATS} beats of {task_name(job, index)}", POLL, on_timeout=None)

    def beat_count(self, job: str, index: int) -> int:
        """How often task (job, index) has beaten so far, all its incarnations together (`wait_for_restart`'s
        `beats_before`)."""
        return self._store.add(self.rendezvous.key("beat", job, index), 0)

    # --- heartbeats --------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        store, key = self._store, self.rendezvous.key("beat")

        def beat() -> None:
            while not self._beating.wait(BEAT_EVERY):
                try:
                    store.add(key, 1)
                except Exception:  # the store is out of reach (this host cut off, etcd electing): beat on once it is
                    continue       # back, or the others take this task for dead; a store gone for good: join() says

        self._beat_thread = threading.Thread(target=beat, name=f"towerflow-heartbeat {self.name}", daemon=True)
        self._beat_thread.start()
        if self.watch is not None:
            watch = self.watch

            def look() -> None:
                while not self._beating.wait(_watch.WATCH_EVERY):
                    try:
                        watch.tick()
                    except Exception:  # the store out of reach for a moment: as for the beats, look again
                        continue

            self._watch_thread = threading.Thread(target=look, name=f"towerflow-watch {self.name}", daemon=True)
            self._watch_thread.start()

    def stop(self) -> None:
        """Stop beating and watching (the others then see this task silent unless it said it is done)."""
        self._beating.set()
        for thread in (self._beat_thread, self._watch_thread):
            if thread is not None:
                thread.join(2 * BEAT_EVERY)

    def beat_keys_of(self, tasks: Sequence[DeviceSpec]) -> List[str]:
        """The tasks' beat keys, then their incarnation keys (as `beats_of` reads them)."""
        rv = self.rendezvous
        return [rv.key(kind, t.job, t.task) for kind in ("beat", "incarnation") for t in tasks]

    def beats_of(self, tasks: Sequence[DeviceSpec]) -> List[Tuple[int, int]]:
        """Each task's heartbeat count and incarnation: two store calls for all of them (a check and a
        multi_get; docs/scaling.md), or, while one of them has not written both yet, three per task."""
        rv, keys = self.rendezvous, self.beat_keys_of(tasks)
        if tasks and self._store.check(keys):
            values = [int(v) for v in self._store.multi_get(keys)]
            return list(zip(values[:len(tasks)], values[len(tasks):]))
        return [(self._store.add(rv.key("beat", t.job, t.task), 0), self.incarnation_of(t.job, t.task)) for t in tasks]

    def done_tasks(self) -> frozenset:
        """(job, index) of every task that has said it is done (ending.MarkedTasks)."""
        return self._marked.read(self.rendezvous)[0]

    def stood_in(self) -> frozenset:
        """(job, index) of every task another task stands in for (`stand_in`; ending.MarkedTasks)."""
        return self._marked.read(self.rendezvous)[1]

    def stood_in_by(self, job: str, index: int) -> Optional[str]:
        """The call name of the task that does task (job, index)'s work now (`stand_in`), or None."""
        key = self.rendezvous.key("stood_in", job, index)
        return self._store.get(key).decode() if self._store.check([key]) else None

    def stand_in(self, job: str, index: int, by: Optional[str]) -> None:
        """Say that another task (`by`, its call name) does task (job, index)'s work now, so that nobody waits for that
        task any more: it may never come back (its host lost for good). None: it is back. A replicated ps task's
        backup says so when it serves the lost task's part (ps/server/endpoints.py); the task's next incarnation
        takes it back as it joins."""
        key = self.rendezvous.key("stood_in", job, index)
        if by is not None:
            self._store.set(key, by)
        elif not self._store.check([key]) or not self._store.delete_key(key):
            return
        _ending.count_change(self._store, key, by is not None)

    def failures_of(self, tasks: Sequence[DeviceSpec]) -> Iterator[_failures.FailureRecord]:
        """The final failures among `tasks`, the first recorded first, read as they are asked for: one store call
        while no new failure is recorded, then the failed tasks' records only (`RecordedTasks`), so that a check
        that stops at the first costs a few calls even when hundreds of tasks failed in its wake."""
        recorded = self._recorded.of(self._store)
        if not recorded:  # the common case, every second of every waiting task: nothing more to build
            return
        among = {(t.job, t.task) for t in tasks}
        for job, index in recorded:
            if (job, index) in among:
                failed = self.final_failure(job, index)
                if failed is not None:
                    yield failed

    def _silence_limit(self, incarnation: int) -> float:
        """How long a task of `incarnation` may be silent: the join timeout on top while it may be restarted."""
        return self.heartbeat_timeout + (self.join_timeout if incarnation < self.max_restarts else 0.0)

    def check_heartbeats(self, running: List[DeviceSpec], seen: Dict[str, tuple]) -> None:
        """A task that stopped beating without saying it is done was killed or hangs: fail instead of waiting forever.

        A task the launcher may still restart (`--max-restarts`) gets the join timeout on top,
        the time a restarted task has to come back; its new incarnation beats the same counter.
        In a large cluster the group watchers judge the silence and this reads their verdicts (watch.py).
        """
        if self.watch is not None:
            for lost in self.watch.lost_among(running, self.incarnation_of):
                raise self._silence_error(lost["job"], lost["index"], lost["silent_s"], lost["incarnation"])
            return
        now = time.monotonic()
        watched = {task_name(t.job, t.task) for t in running}
        for name in [n for n in seen if n not in watched]:  # done or stood in for meanwhile: its silence then does not
            del seen[name]  # count when it is watched again (a restarted incarnation takes its done back before it beats)
        for t, (count, incarnation) in zip(running, self.beats_of(running)):
            name = task_name(t.job, t.task)
            last = seen.get(name)
            if last is None or last[0] != (count, incarnation):  # a beat, or a restarted incarnation: alive again
                seen[name] = ((count, incarnation), now)
                continue
            silent = now - last[1]
            if silent > self._silence_limit(incarnation):
                raise self._silence_error(t.job, t.task, silent, incarnation)

    def _silence_error(self, job: str, index: int, silent: float, incarnation: int) -> PeerLost:
        name = task_name(job, index)
        waited = (
            f"{silent:.0f} s (it may be restarted: {incarnation} of {self.max_restarts} restarts used, and "
            f"the wait includes {_taskenv.ENV_JOIN_TIMEOUT}={self.join_timeout:g} s for it to come back)"
            if incarnation < self.max_restarts else f"{self.heartbeat_timeout:g} s"
        )
        return PeerLost(
            f"{name} at {self.cluster.task_address(job, index)} stopped answering: no heartbeat for "
            f"{waited} and it never finished. It was killed or is hung; restart the cluster, or launch with "
            f"--max-restarts N so the launcher restarts it (the wait is {_taskenv.ENV_HEARTBEAT_TIMEOUT}).",
            task=name,
            incarnation=incarnation,
        )

    # --- watching while waiting --------------------------------------------------------------

    def check_peers(self, seen: Dict[str, tuple], serving: Sequence[str] = ()) -> None:
        """Raise PeerLost when another task that has not finished failed, or has stopped beating
        for longer than it could take to come back. Call it repeatedly with the same `seen` dict while
        waiting on other tasks, so that a dead one ends the wait instead of hanging it. Tasks of the
        jobs in `serving` (a worker waiting on the ps) are watched even once done; tasks another one stands in
        for (`stand_in`) are not."""
        rv, (done, stood_in) = self.rendezvous, self._marked.read(self.rendezvous)
        running = [t for t in self.cluster.tasks() if (t.job, t.task) != (rv.job, rv.index) and (
                   t.job in serving or (t.job, t.task) not in done) and (t.job, t.task) not in stood_in]
        for failed in self.failures_of(running):
            raise PeerLost(f"{failed.task} {failed.summary}", task=failed.task)
        self.check_heartbeats(running, seen)

    def wait_watching(self, future, serving: Sequence[str] = (), task: Optional[tuple] = None, every: float = 1.0) -> None:
        """Return once the torch `future` is done. Meanwhile watch heartbeats (of `task` = (job, index)
        only, or of every running task and the jobs in `serving`), so that a call to a task that died or
        was cut off by the network ends with ClusterError naming it instead of waiting forever."""
        seen: Dict[str, tuple] = {}
        woken = threading.Event()  # set by the future, and by the group watch when it reads a published loss
        with self.watch.waking(woken) if self.watch is not None else contextlib.nullcontext():
            if task is not None:
                wait_for(future, lambda: self.check_heartbeats([DeviceSpec(job=task[0], replica=0, task=task[1])], seen),
                         every, woken)
            else:
                wait_for(future, lambda: self.check_peers(seen, serving), every, woken)

    def wait_until_all_done(self, timeout: Optional[float]) -> None:
        """The end barrier: return once every task is done and the cluster's end is decided (ending.py).

        Raises PeerLost naming a task that failed for good or went silent, and
        ClusterTimeoutError when `timeout` seconds pass first.
        """
        rv = self.rendezvous
        deadline = None if timeout is None else time.monotonic() + timeout
        tasks = self.cluster.tasks()
        seen: Dict[str, tuple] = {}  # task -> (last heartbeat count, when it last changed)
        while True:
            for failed in self.failures_of(tasks):
                rv.mark("left")  # lets a failed coordinator stop waiting for us
                raise PeerLost(f"{failed.task} {failed.summary}", task=failed.task)
            done = self.done_tasks()
            missing = [t for t in tasks if (t.job, t.task) not in done]
            if not missing and _ending.try_end(self._store, [rv.key("done", t.job, t.task) for t in tasks]):
                _ending.record_end(rv)
                return  # ended once for all: a restarted incarnation now finds it so and does not rejoin
            self.check_heartbeats(missing, seen)
            if deadline is not None and time.monotonic() > deadline:
                raise ClusterTimeoutError(
                    f"{self.name}: tasks still running after {timeout:g} s: "
                    f"{', '.join(task_name(t.job, t.task) for t in missing)}",
                    task=self.name,
                    missing=[task_name(t.job, t.task) for t in missing],
                )
            time.sleep(2 * POLL)


def wait_for(future, check: Callable[[], None], every: float = 1.0, woken: Optional[threading.Event] = None) -> None:
    """Return once the torch `future` is done, calling `check()` every `every` seconds meanwhile, and at once
    whenever `woken` is set (news the check should read): it raises to end the wait (a peer gone, a task
    restarted)."""
    if future.done():
        return
    ready = woken if woken is not None else threading.Event()
    future.add_done_callback(lambda _f: ready.set())
    while True:
        ready.wait(every)
        ready.clear()  # before the future is asked: a completion from now on sets it again, and is not lost
        if future.done():
            return
        check()
