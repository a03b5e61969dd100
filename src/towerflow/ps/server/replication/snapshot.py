"""A `ShardService`'s whole state as one value, and a service made or put back from it.

A checkpoint (`ShardService.state_dict`) keeps what training needs after a restart of every ps task;
a mirror needs more, since it must then decide exactly as the primary would: the coordinator whole
(clocks, active and held workers, counters), the sync sum of held gradients and the tables' held rows,
the last learning rate, the push kind, the hash tables' random generators. This module reads and
writes those fields of the service (its other half: `service.py` stays about serving).
"""

from __future__ import annotations

import copy

from towerflow.errors import ParameterServerError
from towerflow.ps.replication_messages import ServiceSnapshot
from towerflow.ps.server.service import ShardService


def take(service: ShardService) -> ServiceSnapshot:
    """A copy of everything `service` decides from; the caller holds the service's lock."""
    coordinator = service.coordinator
    waiting, released = coordinator.waiting, coordinator._released
    coordinator.waiting, coordinator._released = [], []  # pulls wait on this process, not in the state
    try:
        coordinator_copy = copy.deepcopy(coordinator)
    finally:
        coordinator.waiting, coordinator._released = waiting, released
    optimizer = service.optimizer
    held = tuple(t.clone() for t in service._sum) if service._sum is not None and service._summed else None
    return ServiceSnapshot(
        shards=service.shards,
        values={d: f.detach().clone() for d, f in zip(service.dtypes, service.flats)},
        optimizer_cls=type(optimizer) if optimizer is not None else service.optimizer_cls,
        optimizer_settings=dict(optimizer.defaults) if optimizer is not None else {},
        optimizer_state=copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
        tables=copy.deepcopy(service.tables) if service.tables else None,
        coordinator=coordinator_copy,
        held_sum=held,
        summed=service._summed,
        lr=service.lr,
        push_kind=service.push_kind,
        rejoins=dict(service.rejoins),
        reads=dict(service.reads),
    )


def build(snapshot: ServiceSnapshot) -> ShardService:
    """A new service equal to the one `snapshot` was taken of (a mirror, seeded); `snapshot` becomes its state."""
    c = snapshot.coordinator
    service = ShardService(snapshot.shards, snapshot.values, snapshot.optimizer_cls, snapshot.optimizer_settings,
                           c.policy, c.num_workers, snapshot.tables)
    install(service, snapshot)
    return service


def install(service: ShardService, snapshot: ServiceSnapshot) -> int:
    """Put `snapshot` into `service` (a restarted primary, restored from its mirror); returns the global step.
    The service must hold the same shards; `snapshot`'s objects are taken over, not copied."""
    names = [s.name for s in service.shards]
    if [s.name for s in snapshot.shards] != names:
        raise ParameterServerError(
            f"the mirror holds shards {[s.name for s in snapshot.shards]} and this ps task {names}; every task must "
            "build the same model and layout")
    with service._lock:
        for f, d in zip(service.flats, service.dtypes):
            f.copy_(snapshot.values[d])
        if service.optimizer is not None and snapshot.optimizer_state is not None:
            service.optimizer.load_state_dict(snapshot.optimizer_state)
        service.tables = snapshot.tables
        service.coordinator = snapshot.coordinator
        service._sum = [t.clone() for t in snapshot.held_sum] if snapshot.held_sum is not None else None
        service._summed = snapshot.summed
        service.lr = snapshot.lr
        service.push_kind = snapshot.push_kind
        service.rejoins.clear()
        service.rejoins.update(snapshot.rejoins)
        service.reads = dict(snapshot.reads)
        return service.coordinator.global_step
