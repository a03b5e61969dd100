"""What crosses the wire between a primary ps task and its backup, and from a backup to the chief.

A shard's primary forwards every call that changes its state, numbered, to the ps task that mirrors
it (`server/replication/replicator.py`), which applies them in that order (`server/replication/mirror.py`):
a `ShardService` decides the same way given the same calls in the same order, so the mirror stays equal to the
primary. Each call is a small frozen op; `ReplicaFrame` numbers one. `ServiceSnapshot` is a whole
service's state (what seeds a mirror, and what the chief restores a lost primary from). Plain data
only, like `messages.py`: both sides and the chief import it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Type, Union

import torch

from towerflow.cluster.spec import split_address
from towerflow.errors import ParameterServerError
from towerflow.ps.layout import ShardSpec
from towerflow.ps.messages import RowPush, RowRead, Ticket
from towerflow.taskenv import MAX_PS_REPLICAS


def check_ps_replicas(replicas: object, num_ps: int) -> int:
    """`ps_replicas` as given, when it is 1, or 2 with at least two ps tasks; else an error saying what to change."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= min(MAX_PS_REPLICAS, num_ps):
        raise ParameterServerError(
            f"ps_replicas={replicas!r} with {num_ps} ps task(s): expected 1 (each ps task's part on it alone) or "
            f"{MAX_PS_REPLICAS} (and a mirror on another ps task, which needs at least 2 ps tasks); launch with "
            f"--ps-replicas 1 or 2 and --ps 2 or more"
        )
    return replicas


def check_replica_lag(lag: object, replicas: int, mode: str) -> int:
    """`ps_replica_lag` as given: 0 (a reply waits for the backup), or N > 0 with two replicas and async training
    (a lost primary may come back without up to N acknowledged pushes, which async SGD can lose; a sync step or an
    SSP clock could not go on without them)."""
    if not isinstance(lag, int) or isinstance(lag, bool) or lag < 0:
        raise ParameterServerError(
            f"ps_replica_lag={lag!r}: expected a whole number >= 0 (0: every reply waits until the backup holds what "
            "it shows; N: replies may run N ops ahead of the backup)")
    if lag and replicas < 2:
        raise ParameterServerError(
            f"ps_replica_lag={lag} with ps_replicas={replicas}: the lag is how far a backup may fall behind, and "
            "there is none; add --ps-replicas 2 (and --ps 2 or more), or drop --ps-replica-lag")
    if lag and mode != "async":
        raise ParameterServerError(
            f"ps_replica_lag={lag} with mode={mode!r}: a restored ps could lack up to {lag} acknowledged pushes, "
            f"which {mode} training cannot lose (a step or a clock would wait for them forever); use mode='async', "
            "or ps_replica_lag=0 (every reply waits for the backup)")
    return lag


def ps_hosts(cluster) -> Tuple[str, ...]:
    """The host of each ps task of `cluster` (a ClusterSpec), as its address names it (the rule of a same-host link)."""
    return tuple(split_address(cluster.task_address("ps", i))[0] for i in range(cluster.num_tasks("ps")))


def backup_ring(hosts: Sequence[str]) -> Tuple[int, ...]:
    """The ring the ps tasks' parts are mirrored along (each task's backup is the next), from each task's host:
    the hosts take turns, so that a backup is on another host wherever the hosts allow and a lost host takes no
    part's every replica with it (tasks 0 and 1 on one host, 2 and 3 on another: 0, 2, 1, 3). On one host: 0, 1, 2..."""
    by_host: Dict[str, list] = {}
    for task, host in enumerate(hosts):
        by_host.setdefault(host, []).append(task)
    turns = max((len(tasks) for tasks in by_host.values()), default=0)
    return tuple(tasks[turn] for turn in range(turns) for tasks in by_host.values() if turn < len(tasks))


def backup_of(task: int, hosts: Sequence[str]) -> int:
    """The ps task that mirrors `task`'s shards: the next one round the ring (`backup_ring`; `hosts`: `ps_hosts`)."""
    ring = backup_ring(hosts)
    return ring[(ring.index(task) + 1) % len(ring)]


def backup_for(task: int, hosts: Sequence[str], replicas: int) -> Optional[int]:
    """The ps task that mirrors `task`'s shards with `replicas` copies of each; None with one copy."""
    return backup_of(task, hosts) if replicas > 1 else None


def unreplicated_key(model: str, primary: str) -> str:
    """Where a primary incarnation (its call name) says that it may have answered workers without its backup: "1"
    from its backup's loss until a new backup acknowledges its seed, then "0". Its mirror may lack what those
    answers showed, so the chief does not restore from a mirror whose feeder said "1". The backup writes
    `PROMOTED` there when it takes the lost incarnation's place; from then on that incarnation may answer no
    worker, and a mirror it outran is never promoted (each moves the key by compare-and-set: `move_key`)."""
    return f"ps/{model}/unreplicated/{primary}"


MIRROR_HOLD_BYTES = 64 << 20  # a mirror holds queued ops unapplied up to this many bytes of their tensors
REFRESH_FACTOR = 16  # a primary whose state is small seeds its mirror anew after this many states' bytes of ops,
REFRESH_BYTES = 32 << 20  # and not before this many (a seed costs a snapshot, an op held in a ring only its copy);
# no more than one worker's ring holds in bytes (mirror_link.RING_BYTES)
REFRESH_OPS = 512  # and after at most this many ops, however small: half of what a same-host ring holds
# (mirror_link.RING_MAX_SLOTS), so that none fills before its backup takes its records at the seed

PROMOTED = "promoted"  # unreplicated_key's value once the backup serves the primary's part: final


def move_key(swap: Callable[[str, str, str], str], key: str, desired: str, over: Sequence[str]) -> str:
    """Set `key` to `desired` if it holds one of `over` ("": absent), by compare-and-set (`swap(key, expected,
    desired)` returns the value held after); the value it holds now: `desired`, or the one that stopped it."""
    seen = over[0]
    for _ in range(len(over) + 1):
        found = swap(key, seen, desired)
        if found == desired:
            return desired
        found = "" if found == seen else found  # `seen` given back: the key is absent (the store's rule)
        if found not in over:
            return found
        seen = found
    return seen


def part_key(model: str, primary: int) -> str:
    """The name a promoted backup serves ps task `primary`'s part of `model` under, beside its own part (`model`)."""
    return f"{model}@{primary}"


def is_part_key(name: str) -> bool:
    """Whether a model name is a `part_key`: a part a backup serves while promoted."""
    return "@" in name


@dataclasses.dataclass(frozen=True)
class PushOp:
    """A worker's push (`ShardService.push`'s arguments)."""

    worker: int
    ticket: Ticket
    grads: Sequence[torch.Tensor]
    lr: Optional[float]
    rows: Optional[RowPush]
    kind: str


@dataclasses.dataclass(frozen=True)
class FinishOp:
    """A worker finished (at the moment the primary counted it, its late pushes already in)."""

    worker: int


@dataclasses.dataclass(frozen=True)
class RejoinOp:
    """A restarted worker came back (it may change what its next sync push counts as)."""

    worker: int


@dataclasses.dataclass(frozen=True)
class LoadStateOp:
    """The chief put a checkpoint back."""

    state: dict
    finished: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RowsReadOp:
    """A read of hash-table rows (it counts sightings and may admit ids)."""

    request: RowRead


@dataclasses.dataclass(frozen=True)
class ServiceSnapshot:
    """Everything a `ShardService` decides from: values, optimizer and table state, the coordinator with its
    clocks and held pushes, the sync sum. A mirror seeded with it, then given the same ops, stays equal."""

    shards: Tuple[ShardSpec, ...]
    values: Dict[torch.dtype, torch.Tensor]
    optimizer_cls: Type[torch.optim.Optimizer]
    optimizer_settings: Dict[str, Any]
    optimizer_state: Optional[dict]
    tables: Any  # a TableShards, or None
    coordinator: Any  # a Coordinator without waiting pulls
    held_sum: Optional[Tuple[torch.Tensor, ...]]
    summed: int
    lr: Optional[float]
    push_kind: Optional[str]
    rejoins: Dict[int, int]
    reads: Dict[int, int]

    def nbytes(self) -> Optional[int]:
        """The bytes of its tensors (values, optimizer state, held sum); None with tables (too large to send often)."""
        if self.tables is not None:
            return None
        tensors = list(self.values.values()) + list(self.held_sum or ())
        state = (self.optimizer_state or {}).get("state", {})
        tensors += [t for per_param in state.values() for t in per_param.values() if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def op_nbytes(op: "ReplicaOp") -> int:
    """The bytes of an op's tensors (a push's gradients and rows; the other ops carry next to none)."""
    if isinstance(op, PushOp):
        return sum(g.numel() * g.element_size() for g in op.grads) + (op.rows.nbytes if op.rows is not None else 0)
    return 0


@dataclasses.dataclass(frozen=True)
class SeedOp:
    """Replace the mirror with this snapshot; the ops numbered after it follow. A `refresh` takes no number of its own:
    it is the state after the op its frame's number names, which the backup holds already (every op before it), so
    no reply waits for it and the ops after it may arrive first; it only spares the backup applying them."""

    snapshot: ServiceSnapshot
    refresh: bool = False


@dataclasses.dataclass(frozen=True)
class DropOp:
    """The part is no longer served by the sender (a promoted backup gave it back to its primary): the mirror it fed
    stands for nothing now, and its memory is let go."""


ReplicaOp = Union[PushOp, FinishOp, RejoinOp, LoadStateOp, RowsReadOp, SeedOp, DropOp]


@dataclasses.dataclass(frozen=True)
class ReplicaFrame:
    """One op for the mirror of ps task `primary`'s part of `model`, number `seq` (1, 2, ...; a seed restarts
    the count at its own number), sent by incarnation `sender` (its call name)."""

    model: str
    primary: int
    sender: str
    seq: int
    op: ReplicaOp


@dataclasses.dataclass(frozen=True)
class MirrorState:
    """What a backup holds of a primary's part of a model: the snapshot after its last op, who fed it, and
    how many ops; `snapshot` None when it holds no mirror (it was restarted since, or never seeded)."""

    snapshot: Optional[ServiceSnapshot]
    fed_by: Optional[str]
    seq: int
    served: bool = False  # the backup served the part itself (promoted) until this read: nothing newer exists
