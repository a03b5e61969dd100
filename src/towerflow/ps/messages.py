"""What crosses the wire between a worker and a ps task: small frozen requests and replies, and the
names of the calls.

Both sides import this module and it imports neither, so it holds only plain data. The worker
describes what it wants (`PolicySpec` rather than a policy object: the ps builds and owns its
policy); the ps answers with typed replies rather than tuples, so a reply says what it is
(`PushPulled` vs `Pulled`) instead of being told apart by its length. A call names its ps function
by an `Endpoint` (`Endpoints` lists them), so a worker calls the ps's code without importing it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch

from towerflow.cluster.calls import wire
from towerflow.errors import ParameterServerError
from towerflow.ps import key_steps
from towerflow.ps.key_steps import WireKeys
from towerflow.ps.layout import ShardSpec
from towerflow.ps.tables import TableSpec
from towerflow.ps.tables.row_optimizers import RowOptimizer

# The ps module that resolves a call's name (`endpoint(name)`): named, not imported, since a worker runs no ps code.
ENDPOINTS_MODULE = "towerflow.ps.server.endpoints"


@functools.lru_cache(maxsize=None)
def _endpoint_function(name: str) -> Callable:
    """The ps's call `name`: what an `Endpoint` becomes when the ps unpickles a call (every step's call
    names one, so each is looked up once)."""
    return importlib.import_module(ENDPOINTS_MODULE).endpoint(name)


@wire.names_a_function
@dataclasses.dataclass(frozen=True)
class Endpoint:
    """A call of the ps, by name: it pickles as a reference that the ps unpickles as the function that runs it
    there, so `calls.endpoint.call_async(ps, Endpoint("pull"), ...)` runs the ps's `pull`."""

    name: str

    def __reduce__(self):
        return _endpoint_function, (self.name,)


class Endpoints:
    """Every call a worker makes on a ps task (a method of the same name of the ps's `endpoints.ServedModels`)."""

    create = Endpoint("create")
    open_model = Endpoint("open_model")
    wait_ready = Endpoint("wait_ready")
    rejoin = Endpoint("rejoin")
    pull = Endpoint("pull")
    push_pull = Endpoint("push_pull")
    push_pull_flat = Endpoint("push_pull_flat")  # a dense step as plain values: no pickle on the wire
    attach_link = Endpoint("attach_link")
    read_rows = Endpoint("read_rows")
    finish = Endpoint("finish")
    wait_finished = Endpoint("wait_finished")
    metrics = Endpoint("metrics")
    state = Endpoint("state")
    load_state = Endpoint("load_state")
    values = Endpoint("values")
    table_values = Endpoint("table_values")
    holds = Endpoint("holds")
    replicate = Endpoint("replicate")  # ps to ps: an op for a mirror (replication_messages.py)
    mirror_state = Endpoint("mirror_state")
    attach_mirror_link = Endpoint("attach_mirror_link")  # ps to ps, same host
    promote = Endpoint("promote")  # a worker to a backup: serve the lost primary's part (replication_messages.part_key)


class PartMoved(ParameterServerError):
    """A call to a part its backup served while promoted, after the chief gave it back to its restarted primary:
    the worker follows the part back (ps/worker/recovery.py)."""


@dataclasses.dataclass(frozen=True)
class Ticket:
    """What a pull hands a worker and its next push brings back: the step it read and how far ahead it was."""

    step: int
    gap: int = 0  # ssp: the worker's clock minus the slowest active worker's clock at the pull


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """How the ps combines pushes (`--mode` and its settings); the ps builds its policy from it."""

    mode: str
    num_workers: int
    replicas_to_aggregate: Optional[int] = None
    staleness: Optional[int] = None
    staleness_aware_lr: bool = False


@dataclasses.dataclass(frozen=True)
class CreateShards:
    """The chief's request to hold a model's shards; `state` (a checkpoint) and `open_now` when restoring."""

    shards: Tuple[ShardSpec, ...]
    values: Dict[torch.dtype, torch.Tensor]
    optimizer_cls: Type[torch.optim.Optimizer]
    optimizer_settings: Dict[str, Any]
    policy: PolicySpec
    state: Optional[dict] = None
    finished: Tuple[int, ...] = ()  # workers that had finished before a restore
    open_now: bool = False
    task: int = 0  # the ps task this request goes to (the shard of every table it holds)
    tables: Tuple[TableSpec, ...] = ()  # embedding tables: shard `task` of each lives on ps task `task`
    table_values: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # this task's shards, when sent
    row_optimizer: Optional[RowOptimizer] = None
    restored_for: Tuple[str, ...] = ()  # a restore after these restarted ps incarnations (their call names) came back
    backup_task: Optional[int] = None  # --ps-replicas 2: the ps task that mirrors this one's part
    snapshot: Optional[Any] = None  # a ServiceSnapshot from the mirror: restore a lost primary to it
    replica_lag: int = 0  # ops a reply may run ahead of the backup's acks (0: a reply waits, as docs/fault-tolerance.md)
    workers_prefetch: bool = False  # workers pull a step ahead: a reply waits until the backup holds the push it answers


@dataclasses.dataclass(frozen=True)
class RowRead:
    """The rows a worker's batch looks up in the tables here: each table's unique local keys. `number` counts
    the worker's reads (from 1; 0: not counted): a read sent again after a restore from a mirror that already
    counted it is answered without counting its hash ids' sightings twice."""

    worker: int
    tables: Tuple[str, ...]
    keys: Tuple[WireKeys, ...]  # as they travel (`ps/key_steps.py`); `local_keys()` unpacks them
    number: int = 0

    def local_keys(self) -> Tuple[torch.Tensor, ...]:
        return key_steps.unpack_all(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(key_steps.nbytes(k) for k in self.keys)


@dataclasses.dataclass(frozen=True)
class RowPush:
    """A push's table part: each table's unique local keys and their gradient rows (coalesced)."""

    tables: Tuple[str, ...]
    keys: Tuple[WireKeys, ...]  # as they travel (`ps/key_steps.py`); `local_keys()` unpacks them
    grads: Tuple[torch.Tensor, ...]

    def local_keys(self) -> Tuple[torch.Tensor, ...]:
        return key_steps.unpack_all(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(key_steps.nbytes(k) for k in self.keys) + sum(g.numel() * g.element_size() for g in self.grads)


# What a push carries: "grad", gradients for the ps's optimizer; "delta", a local-steps (geo) worker's
# parameter change since its last pull, which the ps adds to its values (ps/worker/local_steps.py).
PUSH_KINDS = ("grad", "delta")


@dataclasses.dataclass(frozen=True)
class PushPull:
    """One training step of one worker: its gradients (or, `kind="delta"`, its parameter delta), then a pull
    for step `clock` (after `after_step`, sync)."""

    worker: int
    ticket: Ticket
    grads: Sequence[torch.Tensor]
    lr: Optional[float]
    clock: int
    after_step: int = 0
    rows: Optional[RowPush] = None
    kind: str = "grad"

    def header(self) -> tuple:
        """A dense step's plain values without its gradients: what a same-host link sends beside its slot."""
        return self.worker, self.ticket.step, self.ticket.gap, self.lr, self.clock, self.after_step, self.kind

    def flat(self) -> tuple:
        """A dense step as plain values, which the wire lays out without pickle (cluster/calls/wire_flat.py)."""
        return (*self.header(), *self.grads)

    @classmethod
    def from_flat(cls, values: Sequence[Any]) -> "PushPull":
        worker, step, gap, lr, clock, after_step, kind, *grads = values
        return cls(worker, Ticket(step, gap), grads, lr, clock, after_step, None, kind)


@dataclasses.dataclass(frozen=True)
class Pulled:
    """The ps's values (one flat tensor per dtype) and the ticket the worker's next push brings back."""

    ticket: Ticket
    values: List[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class PushOutcome:
    """What became of a push: 'applied', 'held' (sync, for the aggregated update) or 'dropped' (stale)."""

    kind: str
    staleness: int
    global_step: int


@dataclasses.dataclass(frozen=True)
class PushPulled:
    """The reply to a `PushPull`: what became of the push, then the pull."""

    outcome: PushOutcome
    pulled: Pulled

    def header(self) -> tuple:
        """The reply's plain values without the pulled values (see `PushPull.header`)."""
        o, t = self.outcome, self.pulled.ticket
        return o.kind, o.staleness, o.global_step, t.step, t.gap

    def flat(self) -> tuple:
        """The reply as plain values (see `PushPull.flat`)."""
        return (*self.header(), *self.pulled.values)

    @classmethod
    def from_flat(cls, values: Sequence[Any]) -> "PushPulled":
        kind, staleness, global_step, step, gap, *pulled = values
        return cls(PushOutcome(kind, staleness, global_step), Pulled(Ticket(step, gap), pulled))


@dataclasses.dataclass(frozen=True)
class EarlierWorkers:
    """The workers of a checkpoint that a ps restored into a job of another worker count: how many there
    were and each one's clock (pushes) then. The new workers read on from their positions (docs/data.md)."""

    num_workers: int
    clocks: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Rejoined:
    """A worker's place at one ps after a loss: the global step, its pushes there, whether it had finished,
    and the worker counts that the job's checkpoints were restored from (oldest first; its pushes count
    from the last of those restores)."""

    global_step: int
    pushes: int
    finished: bool
    earlier: Tuple[EarlierWorkers, ...] = ()
