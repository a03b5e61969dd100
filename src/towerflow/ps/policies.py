"""The three ways a parameter server combines pushed gradients, as policy objects.

A policy answers two questions for the coordinator (`coordinator.py`), and nothing else:
what to do with a push (apply it now, hold it for an aggregated update, or drop it as
stale), and whether a worker may pull parameters for its next step yet.

* `AsyncPolicy` — TF's default between-graph replication: every push is applied at once.
* `SyncPolicy` — `tf.train.SyncReplicasOptimizer`: one update per `replicas_to_aggregate`
  gradients of the current step, their mean; gradients computed from an older step are
  dropped and counted, so with `total_replicas > replicas_to_aggregate` the extra (backup)
  workers make one slow worker harmless. A worker waits for the step to advance before it
  pulls again (TF's sync token queue).
* `SSPPolicy` — stale-synchronous parallel: pushes are applied at once, but a worker may not
  start a step more than `staleness` clocks ahead of the slowest active worker (a clock is
  one push). `staleness=0` is bulk-synchronous; no bound is async.

Staleness is counted in the policy's unit: updates applied since the worker's pull (async,
sync), or clocks ahead of the slowest worker at the pull (ssp, where the bound applies).

The ps builds its policy from the worker's `PolicySpec` (`make_policy`); the worker's strategy
builds one too, only to refuse a bad mode or setting before anything is sent.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Protocol, Sequence

from towerflow.errors import ParameterServerError, did_you_mean
from towerflow.ps.messages import PolicySpec, Ticket


class Coordinator(Protocol):
    """What a policy reads of the ps's coordinator (`ps/server/coordinator.py`): nothing else."""

    global_step: int
    held: Sequence[int]  # workers whose gradients wait for an aggregated update
    active: Sequence[int]  # workers that have not finished
    clocks: Dict[int, int]  # each worker's pushes

MODES = ("async", "sync", "ssp")


@dataclasses.dataclass(frozen=True)
class PullRequest:
    """A worker asking for parameters to compute its step number `clock` (the pushes it has sent so far)."""

    worker: int
    clock: int = 0
    after_step: int = 0  # sync: the global step must have reached this (its last push's step + 1)
    key: object = None  # the caller's handle for a pull that has to wait (the service keeps a future there)


# ---- what the coordinator tells the service to do with a push
@dataclasses.dataclass(frozen=True)
class Apply:
    """Apply the held gradients of `workers` (their mean) now, with the learning rate times `lr_scale`."""

    workers: tuple
    lr_scale: float
    staleness: int


@dataclasses.dataclass(frozen=True)
class Hold:
    """Keep this gradient for the aggregated update of the current step (sync): `have` of `need` so far."""

    have: int
    need: int
    staleness: int = 0


@dataclasses.dataclass(frozen=True)
class Drop:
    """Discard this gradient: it was computed from step `step`, older than the current one (sync)."""

    step: int
    staleness: int


class UpdatePolicy:
    """Base class: how pushes become updates and when a worker may pull."""

    name = "policy"
    staleness_aware_lr = False
    aggregates = False  # whether pushes are held until a set of them makes one update (the state is Collecting)

    def need(self, c: Coordinator) -> int:
        """How many gradients make one update now."""
        return 1

    def on_finish(self, c: Coordinator) -> Optional["Apply"]:
        """A worker finished: an update the held gradients now make, or None."""
        return None

    def on_push(self, c: Coordinator, worker: int, ticket: Ticket):  # pragma: no cover - abstract
        raise NotImplementedError

    def pull_blocker(self, c: Coordinator, request: PullRequest) -> Optional[str]:
        """Why `request` must wait, or None when it may go now."""
        return None

    def ticket(self, c: Coordinator, request: PullRequest) -> Ticket:
        return Ticket(c.global_step)

    def _scale(self, staleness: int) -> float:
        return 1.0 / max(1, staleness) if self.staleness_aware_lr else 1.0

    def describe(self) -> str:
        return self.name


class AsyncPolicy(UpdatePolicy):
    """Apply every push at once; staleness = updates applied since the worker pulled."""

    name = "async"

    def __init__(self, staleness_aware_lr: bool = False):
        self.staleness_aware_lr = staleness_aware_lr

    def on_push(self, c, worker, ticket):
        s = c.global_step - ticket.step
        return Apply((worker,), self._scale(s), s)

    def describe(self) -> str:
        return "async" + (" (lr / staleness)" if self.staleness_aware_lr else "")


class SyncPolicy(UpdatePolicy):
    """One update per `replicas_to_aggregate` fresh gradients; stale ones dropped (SyncReplicasOptimizer)."""

    name = "sync"
    aggregates = True

    def __init__(self, replicas_to_aggregate: int, total_replicas: int):
        if replicas_to_aggregate < 1 or total_replicas < replicas_to_aggregate:
            raise ParameterServerError(
                f"replicas_to_aggregate={replicas_to_aggregate!r} with total_replicas={total_replicas!r}: expected "
                "1 <= replicas_to_aggregate <= total_replicas (the extra workers are backups); lower "
                "--replicas-to-aggregate or add workers"
            )
        self.replicas_to_aggregate = replicas_to_aggregate
        self.total_replicas = total_replicas

    def need(self, c) -> int:
        # Workers that finished cannot contribute: aggregate what the rest can give.
        return max(1, min(self.replicas_to_aggregate, len(c.active)))

    def on_push(self, c, worker, ticket):
        s = c.global_step - ticket.step
        if s > 0:
            return Drop(ticket.step, s)
        if s < 0:
            raise ParameterServerError(
                f"worker {worker} pushed a gradient for step {ticket.step}, ahead of the ps's step {c.global_step}; "
                "its ticket comes from another ps or another run — restart the job with fresh ps tasks"
            )
        if worker in c.held:
            raise ParameterServerError(
                f"worker {worker} pushed twice for step {ticket.step}; a sync worker must pull (and wait for the "
                "next step) between pushes"
            )
        have, need = len(c.held) + 1, self.need(c)
        if have >= need:
            return Apply(tuple(c.held) + (worker,), 1.0, 0)
        return Hold(have, need)

    def on_finish(self, c):
        # the finished worker no longer counts: the held gradients may now be enough
        if c.held and len(c.held) >= self.need(c):
            return Apply(tuple(c.held), 1.0, 0)
        return None

    def pull_blocker(self, c, request):
        if c.global_step < request.after_step:
            return f"waiting for step {request.after_step} ({len(c.held)} of {self.need(c)} gradients of step {c.global_step})"
        return None

    def describe(self) -> str:
        return f"sync ({self.replicas_to_aggregate} of {self.total_replicas} replicas per update)"


class SSPPolicy(UpdatePolicy):
    """Apply pushes at once; a worker waits while it is more than `staleness` clocks ahead of the slowest."""

    name = "ssp"

    def __init__(self, staleness: int, staleness_aware_lr: bool = False):
        if staleness is None or staleness < 0:
            raise ParameterServerError(
                f"staleness={staleness!r}: expected a bound k >= 0 (0 is bulk-synchronous); for no bound use mode='async'"
            )
        self.staleness = staleness
        self.staleness_aware_lr = staleness_aware_lr

    def _gap(self, c, request: PullRequest) -> int:
        clocks = [max(c.clocks.get(w, 0), request.clock) if w == request.worker else c.clocks.get(w, 0) for w in c.active]
        return request.clock - min(clocks) if clocks else 0

    def pull_blocker(self, c, request):
        gap = self._gap(c, request)
        if gap > self.staleness:
            slow = min(c.active, key=lambda w: c.clocks.get(w, 0))
            return f"{gap} clocks ahead of worker {slow} (bound {self.staleness})"
        return None

    def ticket(self, c, request):
        return Ticket(c.global_step, max(0, self._gap(c, request)))

    def on_push(self, c, worker, ticket):
        return Apply((worker,), self._scale(ticket.gap), ticket.gap)

    def describe(self) -> str:
        return f"ssp (staleness bound {self.staleness})" + (" (lr / staleness)" if self.staleness_aware_lr else "")


def make_policy(spec: PolicySpec) -> UpdatePolicy:
    """The policy `spec` describes (`--mode async|sync|ssp`, with `--replicas-to-aggregate N` / `--staleness K`);
    a bad mode or combination raises ParameterServerError saying what to change."""
    if spec.mode not in MODES:
        raise ParameterServerError(f"mode={spec.mode!r}: expected one of {MODES}{did_you_mean(str(spec.mode), MODES)}")
    if spec.mode == "async":
        return AsyncPolicy(spec.staleness_aware_lr)
    if spec.mode == "sync":
        if spec.staleness_aware_lr:
            raise ParameterServerError("staleness_aware_lr has no effect in mode='sync' (applied gradients are never stale); drop it")
        aggregate = spec.num_workers if spec.replicas_to_aggregate is None else spec.replicas_to_aggregate
        return SyncPolicy(aggregate, spec.num_workers)
    return SSPPolicy(0 if spec.staleness is None else spec.staleness, spec.staleness_aware_lr)
