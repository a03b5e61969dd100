"""What the ps tasks hold of a worker's model: the layout of its variables, the optimizer they run, its tables.

Set once by the strategy's `setup` (`PSClient.attach`) and read by every call that (re)creates a ps
task's shards: the chief's first creation, a restore from a checkpoint or a mirror, a resharded load.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from towerflow.ps.layout import Layout
from towerflow.ps.messages import CreateShards, PolicySpec
from towerflow.ps.replication_messages import backup_for, ps_hosts
from towerflow.ps.tables import TableSpec
from towerflow.ps.worker.channel import Channel


@dataclasses.dataclass
class ModelOnPS:
    """The model's variables as laid out on the ps tasks, their optimizer, and its embedding tables."""

    layout: Layout
    params: Dict[str, torch.nn.Parameter]
    optimizer: tuple  # (class, settings): what a restarted ps is rebuilt with
    tables: Dict[str, TableSpec]
    table_values: Dict[str, torch.Tensor]  # tables the chief built with values: sent once, at create
    row_optimizer: Any = None
    replan: Optional[Callable[[int], Layout]] = None  # the layout this model has on n ps tasks (resharding)
    ps_replicas: int = 1  # copies of each ps task's part (2: a mirror on the next ps task, docs/fault-tolerance.md)
    replica_lag: int = 0  # with 2: how many ops a reply may run ahead of the backup (0: none)

    def create_request(self, ch: Channel, cluster, policy: PolicySpec, prefetch: bool, state: Optional[dict] = None,
                       finished: Sequence[int] = (), open_now: bool = False, restored_for: Sequence[str] = (),
                       snapshot: Any = None) -> CreateShards:
        """What asks `ch`'s ps task to hold its shards, restoring `state` (a checkpoint) or `snapshot` (its mirror's)."""
        cls, settings = self.optimizer
        shard_values = {}
        for name, value in self.table_values.items():
            spec = self.tables[name]
            rows, _ = spec.route(torch.arange(spec.rows))
            shard_values[name] = value.detach().to("cpu")[rows == ch.task]
        return CreateShards(
            ch.shards, self.layout.pack(ch.task, self.params), cls, settings, policy, state, tuple(finished),
            open_now, ch.task, tuple(self.tables.values()), shard_values, self.row_optimizer, tuple(restored_for),
            backup_for(ch.task, ps_hosts(cluster), self.ps_replicas), snapshot, self.replica_lag, prefetch)
