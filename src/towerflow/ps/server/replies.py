"""How a ps task's replies go out: `Released` replies complete their futures, which sends them; without a backup
(`--ps-replicas 1`) at once (`UNREPLICATED`), with one once it holds what they show (`replication/replicator.py`)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from towerflow.ps.replication_messages import ReplicaOp

# (a reply's future, its value, the worker it goes to: None for a reply nobody could send again)
Released = List[Tuple[torch.futures.Future, object, Optional[int]]]


def complete(released: Released) -> None:
    for future, value, _ in released:  # outside every lock: completing a future sends the reply
        future.set_result(value)


class Unreplicated:
    """The replica log of a shard that has no backup (`--ps-replicas 1`): nothing forwarded, replies at once."""

    is_replicated = False
    max_lag = 0
    own_push = False

    def forward(self, op: ReplicaOp) -> None:
        pass

    def settle(self) -> None:
        """Nothing to read: no backup."""

    def deliver(self, released: Released) -> None:
        complete(released)

    def settled(self, value: object) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(value)
        return future

    def retire(self) -> None:
        pass

    def metrics(self) -> Optional[dict]:
        return None


UNREPLICATED = Unreplicated()
