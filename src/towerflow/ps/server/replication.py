"""A primary ps task's side of replication: forward each state-changing call to the backup, in order, and
answer a worker only once the backup holds everything that answer shows.

A `ShardService` is a deterministic state machine over its mutating calls (push, finish, rejoin, a
checkpoint load, a read of hash rows), taken one at a time under its lock; pulls only wait and read.
So the primary numbers each call under that lock and sends it, on the one ordered connection to its
backup, as a `ReplicaFrame`; the backup applies them in that order (`mirror.py`) and answers each
with the number it reached. Every reply to a worker (a pull's values, a push's outcome, a finish)
waits, off the lock, until the backup has acknowledged the last number at the moment the reply was
made: what a worker has seen, the backup has. A lost primary is then restored from its mirror with
nothing acknowledged missing (`ps/worker/recovery.py`).

A lost backup does not stop training: the primary goes on unreplicated (a warning, `degraded` in its
metrics), waits for the launcher to restart the backup task, and seeds the new incarnation with a
snapshot of its whole state, after which forwarding resumes.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import threading
import time
from typing import Callable, List, Optional, Tuple

import torch

from towerflow.ps.replication_messages import ReplicaFrame, ReplicaOp, SeedOp, ServiceSnapshot

Released = List[Tuple[torch.futures.Future, object]]  # (a worker's reply future, its value)


def _complete(released: Released) -> None:
    for future, value in released:  # outside every lock: completing a future sends the reply
        future.set_result(value)


class Unreplicated:
    """The replica log of a shard that has no backup (`--ps-replicas 1`): nothing forwarded, replies at once."""

    is_replicated = False

    def forward(self, op: ReplicaOp) -> None:
        pass

    def deliver(self, released: Released) -> None:
        _complete(released)

    def settled(self, value: object) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(value)
        return future

    def metrics(self) -> Optional[dict]:
        return None


UNREPLICATED = Unreplicated()


class Replicator:
    """Forwards one model's mutating calls on this ps task to the backup's mirror and holds replies until acked.

    Injected, so that tests drive it with fakes: `lock` and `snapshot` are the service's (a snapshot is
    taken under the lock), `call(to, frame)` sends a frame and returns a future of the backup's
    acknowledged number, `is_lost(error)` says whether a failed call means the backup is gone, and
    `wait_for_restart(task, lost_name, cause)` blocks until that task is back, returning its new name.
    """

    is_replicated = True

    def __init__(self, model: str, task: int, sender: str, backup_task: int, lock: threading.Lock,
                 snapshot: Callable[[], ServiceSnapshot], call: Callable[[str, ReplicaFrame], torch.futures.Future],
                 is_lost: Callable[[BaseException], bool], wait_for_restart: Callable[[int, str, str], str],
                 say: Optional[Callable[[str], None]] = None):
        self.model, self.task, self.sender, self.backup_task = model, task, sender, backup_task
        self._service_lock = lock
        self._snapshot = snapshot
        self._call = call
        self._is_lost = is_lost
        self._wait_for_restart = wait_for_restart
        self._say = say or (lambda text: print(f"towerflow: {sender}: {text}", file=sys.stderr, flush=True))
        self.backup: Optional[str] = None  # the backup incarnation's call name while replicating, else None
        self.seq = 0  # the number of the last op sent
        self.acked = 0  # the highest number the current backup acknowledged
        self._lock = threading.Lock()  # guards backup, acked and the held replies (acks come on another thread)
        self._held: List[tuple] = []  # heap of (seq, tiebreak, released): replies waiting for that ack
        self._tiebreak = itertools.count()
        self.forwarded = 0
        self.seeds = 0
        self.backup_losses = 0
        self.degraded_since: Optional[float] = time.monotonic()
        self._watching = False

    # ---- under the service's lock
    def forward(self, op: ReplicaOp) -> None:
        """Number `op` and send it to the backup (called under the service's lock, in the order applied)."""
        if self.backup is None:
            return
        self.seq += 1
        self._send(self.backup, ReplicaFrame(self.model, self.task, self.sender, self.seq, op))

    def _send(self, to: str, frame: ReplicaFrame) -> None:
        self.forwarded += 1
        future = self._call(to, frame)
        future.add_done_callback(lambda f: self._answered(to, frame.seq, f))

    # ---- replies to workers
    def deliver(self, released: Released) -> None:
        """Complete the reply futures once the backup has acknowledged every op sent so far (now, if it has, or
        if there is no backup to wait for)."""
        if not released:
            return
        with self._lock:
            seq = self.seq
            if self.backup is not None and self.acked < seq:
                heapq.heappush(self._held, (seq, next(self._tiebreak), released))
                return
        _complete(released)

    def settled(self, value: object) -> torch.futures.Future:
        """A future of `value` that completes as `deliver` would complete it (for replies made outside it)."""
        future: torch.futures.Future = torch.futures.Future()
        self.deliver([(future, value)])
        return future

    def _answered(self, to: str, seq: int, future: torch.futures.Future) -> None:
        try:
            reached = int(future.value())
        except Exception as error:  # the backup is gone, or its mirror refused the op
            self._backup_failed(to, error)
            return
        with self._lock:
            if to != self.backup:
                return
            self.acked = max(self.acked, min(reached, seq))
            ready = []
            while self._held and self._held[0][0] <= self.acked:
                ready += heapq.heappop(self._held)[2]
        _complete(ready)

    # ---- the backup's loss and return
    def _backup_failed(self, to: str, error: BaseException) -> None:
        lost = self._is_lost(error)
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
        self._say(f"the backup of /job:ps/task:{self.task}'s part of {self.model!r} ({to}) {what}; going on "
                  "unreplicated" + ("; it is seeded again once it is back" if lost else ""))
        if lost:
            self.watch(to, str(error))

    def watch(self, lost_name: str, cause: str) -> None:
        """In a thread: wait for the backup task's next incarnation, then seed it (an error ends the watch)."""
        if self._watching:
            return
        self._watching = True

        def run() -> None:
            try:
                back = self._wait_for_restart(self.backup_task, lost_name, cause)
                self.seed(back)
            except Exception as e:
                self._say(f"the backup /job:ps/task:{self.backup_task} of {self.model!r} is not back ({e}); "
                          f"/job:ps/task:{self.task}'s part stays unreplicated")
            finally:
                self._watching = False

        threading.Thread(target=run, name=f"towerflow-reseed-{self.model}", daemon=True).start()

    def seed(self, to: str) -> None:
        """Make `to` the backup: send it a snapshot of the whole state, then forward every later op."""
        with self._service_lock:
            snapshot = self._snapshot()
            with self._lock:
                self.backup = to  # replies held until now wait for this seed's ack: it holds all they show
                self.seq += 1
                self.seeds += 1
                self.degraded_since = None
                seq = self.seq
            self._send(to, ReplicaFrame(self.model, self.task, self.sender, seq, SeedOp(snapshot)))

    # ---- reporting
    @property
    def is_degraded(self) -> bool:
        return self.backup is None

    def metrics(self) -> dict:
        """What `towerflow top` shows of replication: the backup, ops forwarded, how far its acks lag, degraded."""
        with self._lock:
            return {
                "backup": self.backup,
                "backup_task": self.backup_task,
                "ops_forwarded": self.forwarded,
                "lag": self.seq - self.acked if self.backup is not None else 0,
                "replies_waiting": sum(len(r) for _, _, r in self._held),
                "degraded": self.backup is None,
                "degraded_s": round(time.monotonic() - self.degraded_since, 3) if self.degraded_since else 0.0,
                "backup_losses": self.backup_losses,
                "seeds": self.seeds,
            }
