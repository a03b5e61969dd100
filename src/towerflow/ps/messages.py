"""What crosses the wire between a worker and a ps task: small frozen requests and replies.

The worker describes what it wants in plain data (`PolicySpec` rather than a policy object, so
the ps builds and owns its policy); the ps answers with typed replies rather than tuples, so a
reply says what it is (`PushPulled` vs `Pulled`) instead of being told apart by its length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import torch

from towerflow.ps.layout import ShardSpec
from towerflow.ps.policies import Ticket, UpdatePolicy, make_policy
from towerflow.ps.tables import TableSpec
from towerflow.ps.tables.row_optimizers import RowOptimizer


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """How the ps combines pushes (`--mode` and its settings); the ps builds the policy from it."""

    mode: str
    num_workers: int
    replicas_to_aggregate: Optional[int] = None
    staleness: Optional[int] = None
    staleness_aware_lr: bool = False

    def build(self) -> UpdatePolicy:
        """The policy this spec describes (raises ParameterServerError on a bad combination)."""
        return make_policy(self.mode, num_workers=self.num_workers, replicas_to_aggregate=self.replicas_to_aggregate,
                           staleness=self.staleness, staleness_aware_lr=self.staleness_aware_lr)

    def check(self) -> None:
        """Raise the policy's own error now, on the worker, instead of later on the ps."""
        self.build()

    def describe(self) -> str:
        return self.build().describe()


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


@dataclasses.dataclass(frozen=True)
class RowRead:
    """The rows a worker's batch looks up in the tables here: each table's unique local keys."""

    worker: int
    tables: Tuple[str, ...]
    keys: Tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class RowPush:
    """A push's table part: each table's unique local keys and their gradient rows (coalesced)."""

    tables: Tuple[str, ...]
    keys: Tuple[torch.Tensor, ...]
    grads: Tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.grads))


# What a push carries: "grad", gradients for the ps's optimizer; "delta", a local-steps (geo) worker's
# parameter change since its last pull, which the ps adds to its values (ps/local_steps.py).
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


@dataclasses.dataclass(frozen=True)
class Rejoined:
    """A worker's place at one ps after a loss: the global step, its pushes there, whether it had finished."""

    global_step: int
    pushes: int
    finished: bool
