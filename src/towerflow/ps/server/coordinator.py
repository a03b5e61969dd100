"""The ps-side coordinator: an explicit state machine over pushes, pulls and finished workers.

It holds no tensors and does no I/O, so a test can step it one transition at a time:

    c = Coordinator(SyncPolicy(2, 3), num_workers=3)
    c.pull(PullRequest(worker=0))       # -> Go(ticket)
    c.push(0, ticket)                   # -> Hold(1 of 2); state Collecting(step 0, held (0,))
    c.push(1, ticket)                   # -> Apply((0, 1)); state Collecting(step 1)
    c.push(2, ticket)                   # -> Drop (stale), counted

The policy (`policies.py`) decides; the coordinator keeps the state (global step, clocks,
held gradients, waiting pulls) and the counters the metrics report. The shard service
calls it under its lock and acts on what it returns.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from towerflow.errors import ParameterServerError
from towerflow.ps.messages import EarlierWorkers, Ticket
from towerflow.ps.policies import Apply, Drop, Hold, PullRequest, UpdatePolicy


# ---- states (snapshots; `Coordinator.state` returns one)
@dataclasses.dataclass(frozen=True)
class Open:
    """Every push is applied when it arrives (async, ssp)."""

    step: int


@dataclasses.dataclass(frozen=True)
class Collecting:
    """Sync: holding gradients of `step` from `held` until `need` have arrived."""

    step: int
    held: Tuple[int, ...]
    need: int


@dataclasses.dataclass(frozen=True)
class Finished:
    """Every worker said it is done; no more pushes are expected."""

    step: int


# ---- answers to a pull
@dataclasses.dataclass(frozen=True)
class Go:
    """The pull may be served now; the worker gets `ticket` with the parameters."""

    request: PullRequest
    ticket: Ticket


@dataclasses.dataclass(frozen=True)
class Wait:
    """The pull must wait (`reason`); a later push or finish releases it (`Coordinator.released`)."""

    request: PullRequest
    reason: str


class Coordinator:
    """Global step, per-worker clocks, held gradients and waiting pulls, driven by an `UpdatePolicy`."""

    def __init__(self, policy: UpdatePolicy, num_workers: int):
        if num_workers < 1:
            raise ParameterServerError(f"num_workers={num_workers!r}: expected at least one worker")
        self.policy = policy
        self.num_workers = num_workers
        self.global_step = 0
        self.clocks: Dict[int, int] = {w: 0 for w in range(num_workers)}  # pushes received per worker
        self.active: List[int] = list(range(num_workers))
        self.held: List[int] = []  # sync: workers whose gradient of this step is held
        self.waiting: List[PullRequest] = []
        self._released: List[Go] = []
        # counters the metrics report
        self.applied_updates = 0
        self.applied_gradients = 0
        self.dropped = 0
        self.dropped_by_worker: Dict[int, int] = collections.Counter()
        self.pushes_by_worker: Dict[int, int] = collections.Counter()
        # the worker counts this job's checkpoints were restored from, oldest first; the clocks count from the last
        self.earlier: Tuple[EarlierWorkers, ...] = ()
        self.staleness: Dict[int, int] = collections.Counter()  # staleness -> applied gradients
        self.max_staleness = 0
        self._repeating: set = set()  # sync: restarted workers whose gradient of this step is already held
        self.restores = 0  # times the state was put back from a checkpoint
        self.dropped_after_restore = 0  # pushes computed on values from after the checkpoint that was restored

    # ---- state
    @property
    def state(self):
        if not self.active:
            return Finished(self.global_step)
        if self.policy.aggregates:
            return Collecting(self.global_step, tuple(self.held), self.policy.need(self))
        return Open(self.global_step)

    # ---- transitions
    def pull(self, request: PullRequest):
        """A worker asks for parameters: Go now, or Wait until a push or finish releases it."""
        self._check_worker(request.worker)
        if request.worker not in self.active:  # a finished worker reading the final values waits for no one
            return Go(request, self.policy.ticket(self, request))
        reason = self.policy.pull_blocker(self, request)
        if reason is None:
            return Go(request, self.policy.ticket(self, request))
        self.waiting.append(request)
        return Wait(request, reason)

    def push(self, worker: int, ticket: Ticket):
        """A worker's gradient arrives: returns Apply, Hold or Drop (the service then acts on it)."""
        self._check_worker(worker)
        if worker not in self.active:
            raise ParameterServerError(f"worker {worker} pushed after it said it was done; call finish() only at the end")
        self.pushes_by_worker[worker] += 1
        self.clocks[worker] += 1
        if self.restores and ticket.step > self.global_step:  # read before the restore: those values are gone
            self.dropped_after_restore += 1
            action = Drop(ticket.step, 0)
        elif worker in self._repeating and worker in self.held:  # its earlier incarnation's gradient already counts
            self._repeating.discard(worker)
            action = Drop(ticket.step, 0)
        else:
            action = self.policy.on_push(self, worker, ticket)
        if isinstance(action, Drop):
            self.dropped += 1
            self.dropped_by_worker[worker] += 1
        elif isinstance(action, Hold):
            self.held.append(worker)
        elif isinstance(action, Apply):
            self._count_applied(action)
        self._release()
        return action

    def finish(self, worker: int) -> Optional[Apply]:
        """A worker is done: slower peers stop waiting for it. In sync, held gradients that now make
        a full set are applied (the returned Apply); the service acts on it like a push's."""
        self._check_worker(worker)
        if worker in self.active:
            self.active.remove(worker)
        action = self.policy.on_finish(self)
        if action is not None:
            self._count_applied(action)
        self._release()
        return action

    def rejoin(self, worker: int) -> bool:
        """A restarted worker is back; returns whether it had finished (killed after `finish`: it stays
        finished and pushes no more). In sync mode its killed incarnation may have pushed this step's
        gradient already (it is held): the new incarnation's push for the same step is then dropped."""
        self._check_worker(worker)
        if worker not in self.active:
            return True
        if worker in self.held:
            self._repeating.add(worker)
        return False

    def restore(self, global_step: int, clocks: Dict[int, int], finished=(),
                earlier: Sequence[EarlierWorkers] = ()) -> None:
        """Go back to a checkpoint: its step, clocks and `earlier` worker counts; held gradients are discarded
        and every waiting pull goes (with the restored values), since what it waited for no longer comes.
        A checkpoint of another number of workers (its clocks name every worker) becomes one more of the
        `earlier`, and every clock starts from 0: the new workers count their batches from the restore."""
        self.global_step = int(global_step)
        self.earlier = tuple(earlier)
        if clocks and len(clocks) != self.num_workers:
            if sorted(clocks) != list(range(len(clocks))):
                raise ParameterServerError(
                    f"the checkpoint's clocks name workers {sorted(clocks)}: expected workers 0..{len(clocks) - 1}, one "
                    "clock each; the checkpoint is damaged, restore an earlier one")
            self.earlier += (EarlierWorkers(len(clocks), tuple(int(clocks[w]) for w in range(len(clocks)))),)
            clocks = {}
        for w in range(self.num_workers):
            self.clocks[w] = self.pushes_by_worker[w] = int(clocks.get(w, 0))
        self.held = []
        self._repeating.clear()
        self.active = [w for w in range(self.num_workers) if w not in set(finished)]
        self.restores += 1
        self._released += [Go(r, self.policy.ticket(self, r)) for r in self.waiting]
        self.waiting = []

    def released(self) -> List[Go]:
        """Pulls that were waiting and may go now (each returned once)."""
        out, self._released = self._released, []
        return out

    # ---- internals
    def _count_applied(self, action: Apply) -> None:
        self.applied_updates += 1
        self.applied_gradients += len(action.workers)
        self.staleness[action.staleness] += len(action.workers)
        self.max_staleness = max(self.max_staleness, action.staleness)
        self.held = []
        self._repeating.clear()
        self.global_step += 1

    def _release(self) -> None:
        still = []
        for request in self.waiting:
            if request.worker not in self.active or self.policy.pull_blocker(self, request) is None:
                self._released.append(Go(request, self.policy.ticket(self, request)))
            else:
                still.append(request)
        self.waiting = still

    def _check_worker(self, worker: int) -> None:
        if not (isinstance(worker, int) and 0 <= worker < self.num_workers):
            raise ParameterServerError(
                f"worker={worker!r}: this ps serves workers 0..{self.num_workers - 1}; check that every task was "
                "started with the same cluster spec"
            )

    def metrics(self) -> dict:
        """Counters for the training metrics: updates, dropped stale gradients, staleness histogram."""
        return {
            "global_step": self.global_step,
            "policy": self.policy.describe(),
            "applied_updates": self.applied_updates,
            "applied_gradients": self.applied_gradients,
            "dropped_stale": self.dropped,
            "dropped_by_worker": dict(self.dropped_by_worker),
            "pushes_by_worker": dict(self.pushes_by_worker),
            "staleness_histogram": dict(sorted(self.staleness.items())),
            "max_staleness": self.max_staleness,
            "restores": self.restores,
            "dropped_after_restore": self.dropped_after_restore,
            "held_from": sorted(self.held),  # sync: workers whose gradient of this step waits for the others'
            "waiting_pulls": sorted(r.worker for r in self.waiting),  # workers whose pull waits (sync, ssp)
        }

    def __repr__(self) -> str:
        return f"Coordinator({self.policy.describe()}, {self.state})"
