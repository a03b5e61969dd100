"""The ps service's wire API: what a worker calls on a ps task (through `cluster/calls/endpoint.py`).

Every function takes the model's name first (one ps process may hold several models) and the
requests and replies of `ps/messages.py`. A ps process keeps its `ShardService`s in this module's
registry; the chief creates them (`create`), and the other workers wait until it has
initialized them (`wait_ready`) before their first pull. Functions that may wait (a sync pull,
a finish, a rejoin) are `deferred`: they answer with a future, so the messaging thread never blocks. The
per-step calls that never wait (a row read, a push alone) are `quick`: run where they arrive.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Dict, List, Optional, Sequence

import torch

from towerflow import _log
from towerflow.cluster import server as _server
from towerflow.cluster.link import shm_link as _shm_link
from towerflow.cluster.link import shm_ring as _shm_ring
from towerflow.cluster.calls import endpoint as _calls
from towerflow.cluster.calls.names import call_name
from towerflow.errors import ParameterServerError
from towerflow.ps.messages import CreateShards, PartMoved, PushOutcome, PushPull, PushPulled, RowRead, Ticket
from towerflow.ps.replication_messages import (PROMOTED, DropOp, MirrorState, ReplicaFrame, SeedOp, backup_of, is_part_key,
                                               move_key, part_key, ps_hosts, unreplicated_key)
from towerflow.ps.server import linked as _linked
from towerflow.ps.server import mirror_link as _mirror_link
from towerflow.ps.server import snapshot as _snapshot
from towerflow.ps.server import to_backup as _to_backup
from towerflow.ps.server.mirror import Mirror
from towerflow.ps.server.policies import make_policy
from towerflow.ps.server.replies import UNREPLICATED
from towerflow.ps.server.service import ShardService
from towerflow.ps.tables.table_shards import TableShards

_services: Dict[str, ShardService] = {}
_ready: Dict[str, List[torch.futures.Future]] = collections.defaultdict(list)
_opened: set = set()  # models the chief has initialized; workers start only then
# After a lost ps: the restarted ps incarnations (call names) the chief has restored every ps task for, by model,
# and the rejoins waiting for that. A surviving ps is open all along, so without this gate a worker could read
# its clock there before the chief put it back to the checkpoint.
_restored: Dict[str, set] = collections.defaultdict(set)
_restore_waits: Dict[tuple, List[torch.futures.Future]] = collections.defaultdict(list)
_mirrors: Dict[tuple, Mirror] = {}  # (model, primary task) -> this task's mirror of that primary's part
_dropped: set = set()  # (part key, primary task, sender): feeds of mirrors dropped here (`_drop_mirror`)
_registry_lock = threading.Lock()


def services() -> Dict[str, ShardService]:
    """The models this ps process serves, by name (a copy: for the metrics recorder)."""
    with _registry_lock:
        return dict(_services)


def _get(model: str) -> ShardService:
    service = _services.get(model)
    if service is None:
        if is_part_key(model):  # a part this task served while promoted, given back since
            raise PartMoved(f"this ps task no longer serves {model!r}: its primary is back")
        raise ParameterServerError(
            f"this ps holds no model {model!r} (it has {sorted(_services)}); the chief creates it in strategy.setup() — "
            "was this ps restarted after the chief set it up?"
        )
    return service


def create(model: str, request: CreateShards) -> int:
    """Hold the model's shards here, with the policy built here from the request's spec (a second
    create keeps what exists); load `request.state` when given, and with `open_now` let the
    workers in; with `request.snapshot` (a lost primary's mirror) put that back instead of `state`; with
    `request.backup_task`, replicate to that ps task (seeding it now). Returns the global step."""
    with _registry_lock:
        if model not in _services:
            tables = (TableShards(request.task, request.tables, request.row_optimizer, request.table_values)
                      if request.tables else None)
            _services[model] = ShardService(request.shards, request.values, request.optimizer_cls,
                                             request.optimizer_settings, make_policy(request.policy), request.policy.num_workers,
                                             tables)
        service = _services[model]
    if request.snapshot is not None:
        step = _snapshot.install(service, request.snapshot)
    elif request.state is not None:
        step = service.load_state_dict(request.state, request.finished)
    else:
        step = service.coordinator.global_step
    if request.backup_task is not None and not is_part_key(model):  # a part served while promoted has no backup
        _to_backup.replicate(model, request.task, service, request.backup_task, reseed=request.snapshot is not None,
                             max_lag=request.replica_lag, own_push=request.workers_prefetch)
    if request.open_now:
        open_model(model)
    for incarnation in request.restored_for:
        _mark_restored(model, incarnation, step)
    return step


def _mirror(model: str, primary: int) -> Mirror:
    with _registry_lock:
        mirror = _mirrors.get((model, primary))
        if mirror is None:
            mirror = _mirrors[(model, primary)] = Mirror(model, primary)
    return mirror


@_calls.deferred
def replicate(frame: ReplicaFrame) -> torch.futures.Future:
    """A primary's op for the mirror of its part held here (`mirror.py`): a future of the last op number it holds
    in order (the primary's acknowledgement)."""
    feed = (frame.model, frame.primary, frame.sender)
    if isinstance(frame.op, SeedOp):
        _dropped.discard(feed)  # the same backup serving the part again, promoted anew
    elif isinstance(frame.op, DropOp) or feed in _dropped:
        return _drop_mirror(frame)
    mirror = _mirror(frame.model, frame.primary)
    if isinstance(frame.op, SeedOp) and not mirror.stands_in_for(frame.sender):
        _stop_serving(frame.model, frame.primary)  # a new primary incarnation: a part served here in its place is over
    return mirror.receive(frame)


def _drop_mirror(frame: ReplicaFrame) -> torch.futures.Future:
    """The promoted backup `frame.sender` gave the part back (`DropOp`), or sends late after it did: let go of the
    mirror it fed here; its later frames are refused."""
    future: torch.futures.Future = torch.futures.Future()
    key = (frame.model, frame.primary)
    with _registry_lock:
        _dropped.add((*key, frame.sender))
        mirror = _mirrors.get(key)
    if mirror is not None and mirror.drop(frame.sender):
        with _registry_lock:
            if _mirrors.get(key) is mirror:
                del _mirrors[key]
        _log.get("ps", _server.current().name).info(f"drops its mirror of /job:ps/task:{frame.primary}'s part of "
                                                    f"{frame.model!r}: {frame.sender}, which fed it, gave the part back")
    if isinstance(frame.op, DropOp):
        future.set_result(frame.seq)
    else:
        future.set_exception(ParameterServerError(f"{frame.sender} gave /job:ps/task:{frame.primary}'s part of "
                                                  f"{frame.model!r} back: this task mirrors it for it no more"))
    return future


def attach_mirror_link(model: str, primary: int, offer: _shm_link.LinkOffer, ring: Optional[_shm_ring.RingOffer] = None,
                       sender: str = "") -> bool:
    """Take the pushes of ps task `primary` (the incarnation `sender`) for its mirror here through its shared-memory
    link and ring (`mirror_link.py`); False when their files are not on this host."""
    mirror = _mirror(model, primary)
    try:
        reader = _mirror_link.attach_ring(ring)
    except FileNotFoundError:
        return False
    if reader is not None:
        mirror.add_ring(sender, reader)
    on_end = (lambda: mirror.drop_ring(reader)) if reader is not None else None
    if _shm_link.serve(offer, _mirror_link.handler(mirror.receive), name=f"towerflow-mirror-link-{model}-{primary}",
                       on_end=on_end):
        return True
    if reader is not None:
        mirror.drop_ring(reader)
    return False


def mirror_state(model: str, primary: int) -> MirrorState:
    """This task's mirror of ps task `primary`'s part of the model, whole (the chief restores a lost primary from it);
    a part served here while promoted is given back first (`served` says so): later calls to it raise PartMoved."""
    mirror = _stop_serving(model, primary)
    if mirror is not None:
        return dataclasses.replace(mirror.state(), served=True)
    with _registry_lock:
        mirror = _mirrors.get((model, primary))
    return mirror.state() if mirror is not None else MirrorState(None, None, 0)


def _mirrors_of(model: str, primary: int) -> List[Mirror]:
    """This task's mirrors of ps task `primary`'s part: fed by that task (under `model`), or by a backup that served
    the part while promoted (under its `part_key`). Under the registry's lock."""
    return [m for m in (_mirrors.get((model, primary)), _mirrors.get((part_key(model, primary), primary))) if m is not None]


def promote(model: str, primary: int, lost: str) -> bool:
    """Serve ps task `primary`'s part of the model here, under `part_key`, in place of `lost`, the lost incarnation
    that served it (its primary, or a backup promoted before), from this task's mirror of it, and replicate it on
    to the next ps task: True once served (a second worker's call finds it so), False when no mirror here can stand
    for `lost` (fed by another incarnation, or `lost` said it went on without it)."""
    key = part_key(model, primary)
    with _registry_lock:
        if key in _services:
            return True
        mirror = next((m for m in _mirrors_of(model, primary) if m.fed_by == lost), None)
    service = mirror.promote(lost) if mirror is not None else None
    if service is None:
        return False
    server = _server.current()
    if move_key(server.swap, unreplicated_key(mirror.model, lost), PROMOTED, ("", "0")) != PROMOTED:
        mirror.retire()  # `lost` answered workers without this mirror first
        return False
    with _registry_lock:
        if key in _opened:
            return True  # two workers asked at once: the other call serves it, and says so
        _services.setdefault(key, service)
        _opened.add(key)
    me = call_name("ps", server.task_index, server.incarnation)
    server.membership.stand_in("ps", primary, me)  # nobody waits for `lost` now: its host may never return
    _log.get("ps", server.name).info(f"promoted its mirror of /job:ps/task:{primary}'s part of {model!r} (in place of "
                                     f"{lost}) at global step {service.coordinator.global_step}")
    onward = backup_of(server.task_index, ps_hosts(server.cluster))
    if onward != primary and ("ps", onward) not in server.membership.stood_in():  # else no other task is left for it
        own = _services[model].replica if model in _services else UNREPLICATED  # the same settings as its own part
        _to_backup.replicate(key, primary, service, onward, reseed=False, serving=server.task_index,
                             max_lag=own.max_lag, own_push=own.own_push)
    return True


def _stop_serving(model: str, primary: int) -> Optional[Mirror]:
    """Give back the part of `primary` served here while promoted, if it is; the mirror it was served from."""
    key = part_key(model, primary)
    with _registry_lock:
        served = _services.pop(key, None)
        _opened.discard(key)
        mirrors = _mirrors_of(model, primary)
    mirror = next((m for m in mirrors if m.promoted), None)
    if served is not None:
        served.replica.retire()  # its onward backup lets go of the mirror it held of the part
    if served is None or mirror is None or not mirror.retire():
        return None
    server = _server.current()
    server.membership.stand_in("ps", primary, None)  # (its new incarnation said so as it joined, unless promoted after)
    _log.get("ps", server.name).info(f"gives /job:ps/task:{primary}'s part of {model!r} back at global "
                                     f"step {served.coordinator.global_step}")
    return mirror


def holds(model: str) -> bool:
    """Whether this ps task holds its part of the model (a restarted one does not, until it is restored)."""
    with _registry_lock:
        return model in _services


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


@_calls.deferred
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


@_calls.deferred
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


@_calls.deferred
def pull(model: str, worker: int, clock: int, after_step: int = 0) -> torch.futures.Future:
    """A future of `Pulled` for the worker's step `clock`; it waits while the policy holds the worker back."""
    return _get(model).pull(worker, clock, after_step)


@_calls.deferred
def push_pull(model: str, request: PushPull) -> torch.futures.Future:
    """One training step in one round trip: a future of `PushPulled`."""
    return _get(model).push_pull(request)


@_calls.deferred
def push_pull_flat(model: str, *request: Any) -> torch.futures.Future:
    """`push_pull` of a dense step sent as plain values (`PushPull.flat`): a future of the reply's (`PushPulled.flat`)."""
    return _linked.mapped(_get(model).push_pull(PushPull.from_flat(request)), PushPulled.flat)


def attach_link(model: str, worker: int, offer: _shm_link.LinkOffer) -> bool:
    """Serve `worker`'s push-pulls of the model through its shared-memory link (it is on this host); False when
    the link's files are not here (the worker keeps remote calls)."""
    _get(model)
    return _shm_link.serve(offer, _linked.handler(lambda: _get(model)), name=f"towerflow-link-{model}-{worker}",
                           after=lambda: _settle(model))


def _settle(model: str) -> None:
    """A link thread's work after each reply (`Replicator.settle`); nothing when the model is no longer served here
    (the worker's next call says so)."""
    service = _services.get(model)
    if service is not None:
        service.replica.settle()


@_calls.deferred
def read_rows(model: str, request: RowRead) -> torch.futures.Future:
    """A future of the table rows a worker's batch looks up here, one tensor per table of the request (a read
    that admitted hash ids answers once the backup has the admission too)."""
    service = _get(model)
    rows = service.read_rows(request)
    if service.tables.needs_lock(request.tables):
        return service.replica.settled(rows)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(rows)
    return done


@_calls.quick
def push(model: str, worker: int, ticket: Ticket, grads: List[torch.Tensor], lr: Optional[float] = None) -> PushOutcome:
    """A push alone (no pull back)."""
    return _get(model).push(worker, ticket, grads, lr)


@_calls.deferred
def finish(model: str, worker: int, pushes_sent: Optional[int] = None) -> torch.futures.Future:
    """The worker is done once its `pushes_sent` pushes have arrived: a future of the global step."""
    return _get(model).finish(worker, pushes_sent)


@_calls.deferred
def wait_finished(model: str) -> torch.futures.Future:
    """A future of the final global step, done when every worker has finished."""
    return _get(model).when_all_finished()


def metrics(model: str) -> dict:
    """This ps task's counters for the model (with the mirrors of other tasks' parts it holds, promoted ones' too)."""
    out = _get(model).metrics()
    with _registry_lock:
        mirrors = [m for (name, _), m in _mirrors.items() if name == model or name.startswith(model + "@")]
    if mirrors:
        out["mirrors"] = [m.metrics() for m in mirrors]
    return out


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
