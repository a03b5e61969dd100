"""The ps service's wire API: what a worker calls on a ps task (through `cluster.transport`).

Every function takes the model's name first (one ps process may hold several models) and the
requests and replies of `ps/messages.py`. A ps process keeps its `ShardService`s in this module's
registry; the chief creates them (`create`), and the other workers wait until it has
initialized them (`wait_ready`) before their first pull. Functions that may wait (a sync pull,
a finish, a rejoin) are `deferred`: they answer with a future, so no RPC thread blocks. The
per-step calls that never wait (a row read, a push alone) are `quick`: run where they arrive.
"""

from __future__ import annotations

import collections
import threading
from typing import Dict, List, Optional, Sequence

import torch

from towerflow.cluster import shm_link as _shm_link
from towerflow.cluster import transport as _transport
from towerflow.errors import ParameterServerError
from towerflow.ps.messages import CreateShards, PushOutcome, PushPull, RowRead, Ticket
from towerflow.ps.server import linked as _linked
from towerflow.ps.server.policies import make_policy
from towerflow.ps.server.service import ShardService
from towerflow.ps.tables.table_shards import TableShards

_services: Dict[str, ShardService] = {}
_ready: Dict[str, List[torch.futures.Future]] = collections.defaultdict(list)
_opened: set = set()  # models the chief has initialized; workers start only then
# After a lost ps: the restarted ps incarnations (RPC names) the chief has restored every ps task for, by model,
# and the rejoins waiting for that. A surviving ps is open all along, so without this gate a worker could read
# its clock there before the chief put it back to the checkpoint.
_restored: Dict[str, set] = collections.defaultdict(set)
_restore_waits: Dict[tuple, List[torch.futures.Future]] = collections.defaultdict(list)
_registry_lock = threading.Lock()


def services() -> Dict[str, ShardService]:
    """The models this ps process serves, by name (a copy: for the metrics recorder)."""
    with _registry_lock:
        return dict(_services)


def _get(model: str) -> ShardService:
    service = _services.get(model)
    if service is None:
        raise ParameterServerError(
            f"this ps holds no model {model!r} (it has {sorted(_services)}); the chief creates it in strategy.setup() — "
            "was this ps restarted after the chief set it up?"
        )
    return service


def create(model: str, request: CreateShards) -> int:
    """Hold the model's shards here, with the policy built here from the request's spec (a second
    create keeps what exists); load `request.state` when given, and with `open_now` let the
    workers in. Returns the global step."""
    with _registry_lock:
        if model not in _services:
            tables = (TableShards(request.task, request.tables, request.row_optimizer, request.table_values)
                      if request.tables else None)
            _services[model] = ShardService(request.shards, request.values, request.optimizer_cls,
                                             request.optimizer_settings, make_policy(request.policy), request.policy.num_workers,
                                             tables)
        service = _services[model]
    if request.state is not None:
        step = service.load_state_dict(request.state, request.finished)
    else:
        step = service.coordinator.global_step
    if request.open_now:
        open_model(model)
    for incarnation in request.restored_for:
        _mark_restored(model, incarnation, step)
    return step


def _mark_restored(model: str, incarnation: str, step: int) -> None:
    with _registry_lock:
        _restored[model].add(incarnation)
        waiting = _restore_waits.pop((model, incarnation), [])
    for f in waiting:
        f.set_result(step)


def _after_restore(model: str, incarnation: str) -> torch.futures.Future:
    """A future that completes once the chief has restored this ps task after the loss of `incarnation`'s predecessor."""
    future: torch.futures.Future = torch.futures.Future()
    with _registry_lock:
        if incarnation not in _restored[model]:
            _restore_waits[(model, incarnation)].append(future)
            return future
    future.set_result(0)
    return future


def open_model(model: str) -> int:
    """The chief has initialized (or restored) the model here: workers waiting for it may start."""
    with _registry_lock:
        service = _get(model)
        _opened.add(model)
        waiting = _ready.pop(model, [])
        step = service.coordinator.global_step
    for f in waiting:
        f.set_result(step)
    return step


@_transport.deferred
def wait_ready(model: str) -> torch.futures.Future:
    """A future of the global step, done once the chief has created and initialized the model here."""
    future: torch.futures.Future = torch.futures.Future()
    with _registry_lock:
        if model in _opened:
            step = _services[model].coordinator.global_step
        else:
            _ready[model].append(future)
            return future
    future.set_result(step)
    return future


@_transport.deferred
def rejoin(model: str, worker: int, restarted: bool = True, wait_open: bool = True,
           after_restore_of: Optional[str] = None) -> torch.futures.Future:
    """A worker goes on after a loss (its own restart, or a ps restored from a checkpoint): a future of
    `Rejoined`, so its clock agrees with the ps's; `wait_open`: first wait until the chief opened it;
    `after_restore_of`: first wait until the chief restored this task after that ps incarnation came back."""
    if after_restore_of is not None:
        return _after_restore(model, after_restore_of).then(lambda _f: _get(model).rejoin(worker, restarted))
    if not wait_open:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(_get(model).rejoin(worker, restarted))
        return future
    return wait_ready(model).then(lambda _f: _get(model).rejoin(worker, restarted))


@_transport.deferred
def pull(model: str, worker: int, clock: int, after_step: int = 0) -> torch.futures.Future:
    """A future of `Pulled` for the worker's step `clock`; it waits while the policy holds the worker back."""
    return _get(model).pull(worker, clock, after_step)


@_transport.deferred
def push_pull(model: str, request: PushPull) -> torch.futures.Future:
    """One training step in one round trip: a future of `PushPulled`."""
    return _get(model).push_pull(request)


def attach_link(model: str, worker: int, offer: _shm_link.LinkOffer) -> bool:
    """Serve `worker`'s push-pulls of the model through its shared-memory link (it is on this host); False when
    the link's files are not here (the worker keeps RPC)."""
    _get(model)
    return _shm_link.serve(offer, _linked.handler(lambda: _get(model)), name=f"towerflow-link-{model}-{worker}")


@_transport.quick
def read_rows(model: str, request: RowRead) -> List[torch.Tensor]:
    """The table rows a worker's batch looks up here, one tensor per table of the request."""
    return _get(model).read_rows(request)


@_transport.quick
def push(model: str, worker: int, ticket: Ticket, grads: List[torch.Tensor], lr: Optional[float] = None) -> PushOutcome:
    """A push alone (no pull back)."""
    return _get(model).push(worker, ticket, grads, lr)


@_transport.deferred
def finish(model: str, worker: int, pushes_sent: Optional[int] = None) -> torch.futures.Future:
    """The worker is done once its `pushes_sent` pushes have arrived: a future of the global step."""
    return _get(model).finish(worker, pushes_sent)


@_transport.deferred
def wait_finished(model: str) -> torch.futures.Future:
    """A future of the final global step, done when every worker has finished."""
    return _get(model).when_all_finished()


def metrics(model: str) -> dict:
    """This ps task's counters for the model."""
    return _get(model).metrics()


def state(model: str) -> dict:
    """A checkpoint of this ps task's part of the model (values, optimizer state, step, clocks)."""
    return _get(model).state_dict()


def load_state(model: str, state: dict, finished: Sequence[int] = ()) -> int:
    """Put a `state()` back; returns the restored global step."""
    return _get(model).load_state_dict(state, finished)


def values(model: str) -> Dict[str, torch.Tensor]:
    """Copies of this ps task's shards, by shard name."""
    return {k: v.clone() for k, v in _get(model).values().items()}



def table_values(model: str) -> Dict[str, torch.Tensor]:
    """This ps task's shard of every fixed table of the model, by table name."""
    service = _get(model)
    return service.tables.values() if service.tables else {}
