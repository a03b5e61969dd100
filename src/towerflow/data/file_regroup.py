"""Which records a worker reads when a job is restored onto a different number of workers (N -> M).

Each old worker's remaining share is handed to one new worker, so the epochs in progress end exactly:

* old worker w of N stood at batch c_w of its own deal (epoch c_w // b_w, b_w its batches per epoch);
* the new deal over M starts at epoch S, the first epoch that no old worker has begun (the furthest
  old worker's epoch in progress, plus one);
* new worker j first reads, for each old worker w = j, j + M, j + 2M, ... (w < N), the rest of w's
  epochs before S: its epoch in progress from batch c_w on, then any whole epoch it lagged behind,
  each read with w's deal and w's shuffle, so batch for batch what w would have read; then its own
  deal over M from epoch S on.

So every record is read exactly once in every epoch. A job regrouped again before its remainders are
read hands on the unread remainders the same way (a worker's plan is remainders, then its deal).
Positions are counted in batches from the start of a worker's plan: a ps worker's clock since the
restore. Pure functions of the record counts; `file_stream.py` reads the plan.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Sequence, Tuple

from towerflow.errors import DataError


@dataclasses.dataclass(frozen=True)
class Handover:
    """A restore onto another number of workers: the checkpoint's worker count and each worker's batches
    trained since its plan began (its clock at the checkpoint)."""

    num_workers: int
    batches: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Span:
    """Old worker `worker` of `num_workers`: its epoch `epoch` from batch `first` to the epoch's end."""

    worker: int
    num_workers: int
    epoch: int
    first: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one worker reads: `spans` (old workers' remainders) in order, then its own deal of
    `num_workers` from epoch `first_epoch` on."""

    worker: int
    num_workers: int
    spans: Tuple[Span, ...] = ()
    first_epoch: int = 0


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where a worker's training stands when its stream starts: batches trained since its plan began, and
    the restores onto other worker counts that made the plan (oldest first)."""

    batches: int
    earlier: Tuple[Handover, ...] = ()


# batches per epoch of worker w's deal over n workers
PerEpoch = Callable[[int, int], int]


def plan_for(worker: int, num_workers: int, earlier: Sequence[Handover], per_epoch: PerEpoch) -> Plan:
    """Worker `worker` of `num_workers`'s plan after the restores `earlier` (oldest first)."""
    plans: List[Plan] = []
    for i, handover in enumerate(earlier):
        _check(handover, i, earlier)
        if not plans:
            plans = [Plan(w, handover.num_workers) for w in range(handover.num_workers)]
        nxt = earlier[i + 1].num_workers if i + 1 < len(earlier) else num_workers
        plans = _regroup(plans, handover.batches, nxt, per_epoch)
    if not plans:
        return Plan(worker, num_workers)
    return plans[worker]


def plan_batches(plan: Plan, per_epoch: PerEpoch) -> int:
    """The batches of a plan's spans (where its own deal begins)."""
    return sum(_span_batches(s, per_epoch) for s in plan.spans)


def _regroup(plans: Sequence[Plan], batches: Sequence[int], m: int, per_epoch: PerEpoch) -> List[Plan]:
    """The plans of m workers that read on from `plans`, each of which trained `batches`."""
    if m < 1:
        raise DataError(f"num_workers={m!r}: expected at least one worker")
    start = max(_epochs_begun(p, c, per_epoch) for p, c in zip(plans, batches))
    rests = [_remainder(p, c, start, per_epoch) for p, c in zip(plans, batches)]
    return [Plan(j, m, tuple(s for rest in rests[j::m] for s in rest), start) for j in range(m)]


def _epochs_begun(plan: Plan, done: int, per_epoch: PerEpoch) -> int:
    """The first epoch of `plan`'s own deal that it has not begun after `done` batches."""
    into_deal = max(0, done - plan_batches(plan, per_epoch))
    return plan.first_epoch - (-into_deal // _per_epoch(plan.worker, plan.num_workers, per_epoch))


def _remainder(plan: Plan, done: int, until: int, per_epoch: PerEpoch) -> List[Span]:
    """What `plan` has left to read after `done` batches, up to its own deal's epoch `until`."""
    out: List[Span] = []
    for span in plan.spans:
        n = _span_batches(span, per_epoch)
        if done >= n:
            done -= n
            continue
        out.append(dataclasses.replace(span, first=span.first + done))
        done = 0
    b = _per_epoch(plan.worker, plan.num_workers, per_epoch)
    epoch, first = plan.first_epoch + done // b, done % b
    return out + [Span(plan.worker, plan.num_workers, e, first if e == epoch else 0) for e in range(epoch, until)]


def _span_batches(span: Span, per_epoch: PerEpoch) -> int:
    return _per_epoch(span.worker, span.num_workers, per_epoch) - span.first


def _per_epoch(worker: int, num_workers: int, per_epoch: PerEpoch) -> int:
    b = per_epoch(worker, num_workers)
    if b < 1:
        raise DataError(f"worker {worker} of {num_workers} has no records to read: a worker count that leaves a worker "
                        "no records cannot be handed on; restore from a checkpoint of fewer workers or with more data")
    return b


def _check(handover: Handover, i: int, earlier: Sequence[Handover]) -> None:
    n, batches = handover.num_workers, tuple(handover.batches)
    if n < 1 or len(batches) != n or any(not isinstance(c, int) or c < 0 for c in batches):
        raise DataError(f"restore {i + 1} of {len(earlier)}: {handover!r}: expected the batches of each of its "
                        f"{n} workers, each a count >= 0")


@dataclasses.dataclass(frozen=True)
class StepPositions:
    """Where the files of a job whose workers step together stand (one batch each per global step): the
    restores onto other worker counts, and the global step of the last one (its workers' plans begin there).
    What a checkpoint of such a job keeps of its files, so that it can be restored onto another count."""

    earlier: Tuple[Handover, ...] = ()
    since_step: int = 0

    def state(self, num_workers: int) -> dict:
        return {"file_workers": num_workers, "file_since_step": self.since_step,
                "file_earlier": [[h.num_workers, list(h.batches)] for h in self.earlier]}

    @classmethod
    def restored(cls, state: object, step: int, num_workers: int) -> "StepPositions":
        """The positions after restoring a checkpoint's `state()` at global step `step` into `num_workers`
        workers: one more restore when the checkpoint had another count (each of its workers trained
        `step - since_step` batches of its plan). A checkpoint without them says nothing: the files go
        on from the step."""
        if not isinstance(state, dict) or "file_workers" not in state:
            return cls()
        earlier = tuple(Handover(int(n), tuple(int(c) for c in b)) for n, b in state.get("file_earlier") or ())
        since, workers = int(state.get("file_since_step", 0)), int(state["file_workers"])
        if workers != num_workers:
            return cls(earlier + (Handover(workers, (step - since,) * workers),), step)
        return cls(earlier, since)

    def resume(self, step: int) -> Resume:
        return Resume(step - self.since_step, self.earlier)
