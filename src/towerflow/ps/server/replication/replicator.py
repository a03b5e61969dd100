"""A primary ps task's side of replication: forward each state-changing call to the backup, in order, and
answer a worker only once nothing it was told can be lost with this task.

A `ShardService` is a deterministic state machine over its mutating calls (push, finish, rejoin, a
checkpoint load, a read of hash rows), taken one at a time under its lock; pulls only wait and read.
So the primary numbers each call under that lock and sends it to its backup as a `ReplicaFrame`; the
backup applies them in that order (`mirror.py`) and acknowledges the last number it holds in order.
A lost primary is then restored from its mirror (`ps/worker/from_mirrors.py`).

What must the backup hold before a worker hears back? Every op the reply shows that nobody else could
send again. A worker keeps its last two pushes (`Channel.sent`), sends again after a restore the ones
the mirror lacks (`ps/worker/recovery.py`), and lets go of a push only after the reply to its next one.
So the reply to a worker's push or pull waits for the backup to hold that worker's previous push (the
acks are cumulative); the ack of the push itself comes back while the worker computes. A worker that prefetches
has one push more in flight when it sends the next (it reads a step's reply after sending the step after), so
for such workers (`own_push`) the reply waits for the push it answers, while they compute anyway. Replies that
nobody could send again (a finish, a load, a read that admitted hash ids) wait for every op sent so
far.

A primary whose whole state is small seeds its mirror anew now and then (`fresh_seeds.py` says when), so that
the backup holds the ops in between without applying them and never runs the primary's optimizer (`mirror.py`).

Asynchronous replication (`max_lag` > 0, async training only) lets a worker's reply run up to `max_lag`
ops ahead of the backup's acks instead: a step never waits for the backup unless it falls that far
behind, and a lost primary comes back without at most `max_lag` acknowledged pushes, which the
workers count and report as lost updates (`ps/worker/recovery.py`).

A lost backup does not stop training: the primary goes on unreplicated (a warning, `degraded` in its
metrics, and a mark in the store so that the chief never restores from the mirror it outran), waits
for the launcher to restart the backup task, and seeds the new incarnation with a snapshot of its
whole state, after which forwarding resumes. A backup that is not restarted may have been cut off,
not lost: it is offered a seed again. The mark is a compare-and-set against the backup's promotion
(`replication_messages.move_key`): a primary whose backup was promoted in its place while it was cut
off, or that cannot reach the store to say it goes on alone, answers nobody again (`fenced`).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from towerflow import _log
from towerflow.errors import ClusterLeftError, ClusterTimeoutError, PeerLost
from towerflow.ps.replication_messages import DropOp, PushOp, ReplicaFrame, ReplicaOp, SeedOp, ServiceSnapshot, op_nbytes
from towerflow.ps.server.replication.fresh_seeds import FreshSeeds
from towerflow.ps.server.replication.own_connections import OwnConnections
from towerflow.ps.server.replies import Released, complete as _complete


class Replicator:
    """Forwards one model's mutating calls on this ps task to the backup's mirror and holds replies until acked.

    Injected, so that tests drive it with fakes: `lock` and `snapshot` are the service's (a snapshot is
    taken under the lock), `call(to, frame)` sends a frame and returns a future of the backup's
    acknowledged number, `is_lost(error)` says whether a failed call means the backup is gone, and
    `wait_for_restart(task, lost_name, cause)` blocks until that task is back, returning its new name.
    `mark_unreplicated(on)` tells the chief whether replies may have gone out that the mirror lacks (a lost backup:
    on, before the first such reply; a new backup's seed acknowledged: off), so that it never restores a stale mirror;
    it returns False when the backup was promoted in this task's place, and then `fenced(why)` ends this task.
    `reconnect(to)` lets the next call to `to` open a new connection (after a loss that may have been a partition).
    `direct(to)`, when given, opens the calling thread's own connection to `to` (a function of a frame
    returning a call whose `result()` is the ack, read in that thread), or returns None in a thread that
    must not wait (the messaging thread): a same-host link's thread then sends its ops and reads their acks
    itself, without two hand-offs to the messaging thread per op (cluster/calls/direct.py). A call marked `op_held`
    stands for its own op alone, held as sent (a same-host ring's record, `mirror_link.py`), not for every
    op before it as an ack does.
    """

    is_replicated = True

    def __init__(self, model: str, task: int, sender: str, backup_task: int, lock: threading.Lock,
                 snapshot: Callable[[], ServiceSnapshot], call: Callable[[str, ReplicaFrame], torch.futures.Future],
                 is_lost: Callable[[BaseException], bool], wait_for_restart: Callable[[int, str, str], str],
                 say: Optional[Callable[[str], None]] = None, direct: Optional[Callable[[str], object]] = None,
                 max_lag: int = 0, own_push: bool = False, mark_unreplicated: Optional[Callable[[bool], bool]] = None,
                 reconnect: Optional[Callable[[str], None]] = None, fenced: Optional[Callable[[str], None]] = None):
        self.model, self.task, self.sender, self.backup_task = model, task, sender, backup_task
        self._service_lock = lock
        self._snapshot = snapshot
        self._call = call
        self._is_lost = is_lost
        self._wait_for_restart = wait_for_restart
        self._say = say or _log.get("ps", sender).info
        self.max_lag = max_lag  # how many ops a worker's reply may run ahead of the backup's acks (0: none)
        self.own_push = own_push  # a worker's reply waits for the push it answers, not the one before (prefetch)
        self.backup: Optional[str] = None  # the backup incarnation's call name while replicating, else None
        self.seq = 0  # the number of the last op sent
        self.acked = 0  # the backup holds every op up to this number
        self._held_alone: set = set()  # numbers above `acked` held by the backup, each on its own (`op_held`)
        self._lock = threading.Lock()  # guards backup, acked and the held replies (acks come on another thread)
        self._held: List[tuple] = []  # heap of (seq, tiebreak, released): replies waiting for that ack
        self._tiebreak = itertools.count()
        self.forwarded = 0
        self.seeds = 0
        self.backup_losses = 0
        self.degraded_since: Optional[float] = time.monotonic()
        self._watching = False
        self._watch_again: Optional[Tuple[str, str]] = None
        self._last_lost: Optional[str] = None  # the backup incarnation whose loss was said last
        self._cut_off_pause = 0.0  # before the next seed offered to a backup that lives on, cut off
        self.retry_every = 1.0  # the first pause before asking again whether a lost backup is back
        # A thread's own connection has its acks read by that thread alone, when its next reply needs them; a reply
        # allowed to run ahead may then wait for an ack another thread holds unread while that thread's worker
        # waits for its own reply. With a lag every op goes by `call`, whose acks complete as they arrive.
        self._own = OwnConnections(direct, self._say) if direct is not None and not max_lag else None
        self._pushes: Dict[int, Tuple[int, int]] = {}  # worker -> numbers of its (previous, last) push sent
        self._mark = mark_unreplicated or (lambda on: True)
        self._fenced = fenced or (lambda why: self._say(f"fenced: {why}"))
        self._reconnect = reconnect or (lambda to: None)
        self._marked = False  # said "unreplicated", not yet taken back
        self._seed_seq = 0  # the number of the current backup's seed
        self.fresh = FreshSeeds()  # when the backup is seeded anew
        self.refreshes = 0
        self.retired = False  # the part is served here no more (`retire`)

    # ---- under the service's lock
    def forward(self, op: ReplicaOp) -> None:
        """Number `op` and send it to the backup (called under the service's lock, in the order applied)."""
        if self.backup is None:
            return
        self.seq += 1
        pushed = isinstance(op, PushOp)
        if pushed:
            self._pushes[op.worker] = (self._pushes.get(op.worker, (0, 0))[1], self.seq)
        self.fresh.forwarded(op_nbytes(op) if pushed else 0)
        frame = ReplicaFrame(self.model, self.task, self.sender, self.seq, op)
        send = self._own.to(self.backup) if self._own is not None else None
        if not send:
            self._send(self.backup, frame)
            return
        self.forwarded += 1
        try:
            call = send(frame)
        except Exception as error:
            self._own.drop(self.backup)
            self._backup_failed(self.backup, error)
            return
        self._own.sent(self.backup, frame.seq, call)

    def _read_own_acks(self, upto: int) -> None:
        """Read the acks of the ops this thread sent on its own connections (outside the service's lock)."""
        if self._own is None:
            return
        for to, seq, call in self._own.unread(upto):
            try:
                reached = int(call.result())
            except Exception as error:
                self._own.drop(to)
                self._backup_failed(to, error)
                continue
            self._acked(to, reached, seq if getattr(call, "op_held", False) else None)

    def _send(self, to: str, frame: ReplicaFrame) -> None:
        self.forwarded += 1
        future = self._call(to, frame)
        future.add_done_callback(lambda f: self._answered(to, frame.seq, f))

    # ---- replies to workers
    def deliver(self, released: Released) -> None:
        """Complete each reply once the backup holds what it needs (module docstring): the worker's previous push,
        or every op so far for a reply to no worker; now, when it does or there is no backup to wait for."""
        gates = [self._gate(worker) for _, _, worker in released]
        self._read_own_acks(max(gates, default=0))
        if self._own is not None:
            self._own.open_wanted(self.backup)
        backup = self.backup
        if backup is not None and self._refresh_due():
            self.seed(backup, refresh=True)
        if not released:
            return
        now = []
        with self._lock:
            for entry, gate in zip(released, gates):
                if self.backup is not None and self.acked < gate:
                    heapq.heappush(self._held, (gate, next(self._tiebreak), [entry]))
                else:
                    now.append(entry)
        _complete(now)

    def settle(self) -> None:
        """After this thread's reply went out (a same-host link's thread, while its worker computes): read the acks of
        every op it sent on its own connection, the newest too. Acks count in order, so one left unread until this
        thread's next op would hold back the other workers' replies that wait for a later op."""
        if self._own is not None:
            self._read_own_acks(self.seq)

    def _gate(self, worker: Optional[int]) -> int:
        """The op the backup must have acknowledged before this reply goes."""
        if worker is None:
            return self.seq
        previous, last = self._pushes.get(worker, (0, 0))
        kept = last if self.own_push else previous  # the newest push the worker could not send again
        return min(kept, self.seq - self.max_lag) if self.max_lag else kept

    def settled(self, value: object) -> torch.futures.Future:
        """A future of `value` that completes once the backup holds every op sent so far."""
        future: torch.futures.Future = torch.futures.Future()
        self.deliver([(future, value, None)])
        return future

    def _answered(self, to: str, seq: int, future: torch.futures.Future) -> None:
        try:
            reached = int(future.value())
        except Exception as error:  # the backup is gone, or its mirror refused the op
            self._backup_failed(to, error)
            return
        self._acked(to, reached)

    def _acked(self, to: str, reached: int, alone: Optional[int] = None) -> None:
        """The backup holds every op up to `reached`, and op `alone` too."""
        with self._lock:
            if to != self.backup:
                return
            self.acked = max(self.acked, reached)
            if alone is not None and alone > self.acked:
                self._held_alone.add(alone)
            held = self._held_alone
            while held and min(held) <= self.acked + 1:  # a few numbers: the ring's ops since the last ack
                self.acked = max(self.acked, min(held))
                held.discard(min(held))
            ready = []
            while self._held and self._held[0][0] <= self.acked:
                ready += heapq.heappop(self._held)[2]
            replicated_again = self._marked and self.acked >= self._seed_seq
            self._marked = self._marked and not replicated_again
            if replicated_again:
                self._last_lost, self._cut_off_pause = None, 0.0
        _complete(ready)
        if replicated_again:
            self._tell_chief(False)

    def _tell_chief(self, unreplicated: bool) -> None:
        try:
            recorded = self._mark(unreplicated)
        except Exception as e:  # the store is unreachable
            what = f"could not record that /job:ps/task:{self.task}'s part of {self.model!r} is " \
                   f"{'un' if unreplicated else ''}replicated ({type(e).__name__}: {e})"
            if unreplicated:  # its backup may be promoted meanwhile: answering alone could fork the part
                self._fenced(what)
            self._say(what)
            return
        if recorded is False:
            self._fenced(f"its backup /job:ps/task:{self.backup_task} serves /job:ps/task:{self.task}'s part of "
                         f"{self.model!r} in its place (promoted while this task was out of reach)")

    # ---- the backup's loss and return
    def _backup_failed(self, to: str, error: BaseException) -> None:
        lost = self._is_lost(error)
        with self._lock:
            if to != self.backup:
                return
            first = not self._marked
            self._marked = True
        if first:  # before any reply goes out without the backup
            self._tell_chief(True)
        with self._lock:
            if to != self.backup:
                return
            self.backup = None
            self.backup_losses += 1
            self.degraded_since = time.monotonic()
            ready = [r for _, _, released in self._held for r in released]
            self._held = []
        _complete(ready)
        what = "was lost" if lost else f"refused an op ({type(error).__name__}: {error})"
        if to != self._last_lost:  # a backup cut off for a while fails each seed offered to it: said once
            self._say(f"the backup of /job:ps/task:{self.task}'s part of {self.model!r} ({to}) {what}; going on "
                      "unreplicated" + ("; it is seeded again once it is back" if lost else ""))
        self._last_lost = to
        if lost:
            self.watch(to, str(error))

    def watch(self, lost_name: str, cause: str) -> None:
        """In a thread: wait for the backup task's next incarnation, then seed it. One that goes on beating, or is
        not restarted within the wait, may live on, cut off from this task (a network partition): it is offered a
        seed again over a new connection, at once and then after pauses doubling up to 30 s (a seed is a snapshot
        taken under the service's lock). Only the news that it will not be restarted ends the watch: a store that
        failed is asked again, and a seed that fails starts the next watch."""
        with self._lock:
            if self.retired:
                return
            if self._watching:  # the seed this watch sends failed already: watch again once it is done
                self._watch_again = (lost_name, cause)
                return
            self._watching = True

        def run() -> None:
            try:
                pause = self.retry_every
                while True:
                    try:
                        back = self._wait_for_restart(self.backup_task, lost_name, cause)
                    except PeerLost as e:
                        self._say(f"the backup /job:ps/task:{self.backup_task} of {self.model!r} will not be back "
                                  f"({e}); /job:ps/task:{self.task}'s part stays unreplicated")
                        return
                    except ClusterTimeoutError:
                        back = lost_name
                    except ClusterLeftError:  # this task is leaving: nothing to seed
                        return
                    except Exception as e:
                        self._say(f"the backup /job:ps/task:{self.backup_task} of {self.model!r} is not back yet "
                                  f"({type(e).__name__}: {e}); still waiting for it")
                        time.sleep(pause)
                        pause = min(2 * pause, 30.0)
                        continue
                    if back == lost_name:  # it lives on, cut off from this task: over a new connection
                        time.sleep(self._cut_off_pause)
                        self._cut_off_pause = min(2 * self._cut_off_pause or self.retry_every, 30.0)
                        self._reconnect(back)
                    self.seed(back)
                    return
            finally:
                with self._lock:
                    self._watching = False
                    again, self._watch_again = self._watch_again, None
                if again is not None:
                    self.watch(*again)

        threading.Thread(target=run, name=f"towerflow-reseed-{self.model}", daemon=True).start()

    def _refresh_due(self) -> bool:
        """Whether the backup is to be seeded anew now (`FreshSeeds`)."""
        return self.fresh.due(self._ring_half_full)

    def _ring_half_full(self) -> bool:
        """Whether this thread's same-host ring to the backup is half full of records written since its last seed."""
        channel = self._own.current(self.backup) if self._own is not None and self.backup is not None else None
        half_full = getattr(channel, "ring_half_full", None)
        return half_full is not None and half_full(self.seeds + self.refreshes)

    def seed(self, to: str, refresh: bool = False) -> None:
        """Make `to` the backup: send it a snapshot of the whole state, then forward every later op (`refresh`: it is
        the backup, seeded anew so that it need not apply the ops before)."""
        with self._service_lock:
            if self.retired or refresh and (self.backup != to or not self._refresh_due()):
                return  # given back, lost meanwhile, or another thread refreshed it
            snapshot = self._snapshot()
            self.fresh.seeded(snapshot.nbytes())
            with self._lock:
                if refresh:  # the state after op `seq`, which the backup holds already: numbered as that op
                    self.refreshes += 1
                else:
                    self.backup = to  # replies held until now wait for this seed's ack: it holds all they show
                    self._held_alone.clear()  # numbers another backup held
                    self.seq += 1
                    self._seed_seq = self.seq
                    self.seeds += 1
                    self.degraded_since = None
                seq = self.seq
            self._send(to, ReplicaFrame(self.model, self.task, self.sender, seq, SeedOp(snapshot, refresh)))

    def retire(self) -> None:
        """The part is served here no more (a promoted backup gave it back to its primary): forward nothing again, let
        the replies held go, and tell the backup to drop the mirror this task fed (`DropOp`)."""
        with self._service_lock, self._lock:  # no op is being numbered meanwhile
            self.retired = True
            backup, self.backup = self.backup, None
            self.seq += 1
            seq = self.seq
            ready = [r for _, _, released in self._held for r in released]
            self._held = []
        _complete(ready)
        if backup is not None:
            self._send(backup, ReplicaFrame(self.model, self.task, self.sender, seq, DropOp()))

    # ---- reporting
    def metrics(self) -> dict:
        """What `towerflow top` shows of replication: the backup, ops forwarded, how far its acks lag, degraded."""
        with self._lock:
            return {
                "backup": self.backup,
                "backup_task": self.backup_task,
                "ops_forwarded": self.forwarded,
                "lag": self.seq - self.acked if self.backup is not None else 0,
                "max_lag": self.max_lag,
                "replies_waiting": sum(len(r) for _, _, r in self._held),
                "degraded": self.backup is None,
                "degraded_s": round(time.monotonic() - self.degraded_since, 3) if self.degraded_since else 0.0,
                "backup_losses": self.backup_losses,
                "seeds": self.seeds,
                "refreshes": self.refreshes,
            }

