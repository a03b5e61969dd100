"""The ps service's wire API: what a worker calls on a ps task (through `cluster/calls/endpoint.py`).

A ps task's state is one `ServedModels`: its `ShardService`s, the gates workers wait at (a model opened by
the chief, a restore after a lost ps), and the mirrors it holds of other tasks' parts. The calls are its
methods: each takes the model's name first (one ps process may hold several models) and the requests and
replies of `ps/messages.py`. The chief creates the services (`create`), and the other workers wait until it
has initialized them (`wait_ready`) before their first pull. Methods that may wait (a sync pull, a finish, a
rejoin) are `deferred`: they answer with a future, so the messaging thread never blocks.

Methods rather than functions over a module's registries, so that the state and what changes it read
together and a test builds the state it needs instead of patching globals. A worker names a call by a
`messages.Endpoint`, which the ps unpickles as `endpoint(name)`: that method run on this task's
`ServedModels`, which the call layer keeps for as long as the task serves (`calls.endpoint.served`). It is
made by the ps's program as it starts serving (`ps/serve.py`), or by the first call to a ps task that a
script serves with `Server().join()`. The name is resolved per call, not bound once: the receiver keeps the
function a name unpickles to for the life of the process, which may serve more than one task in turn.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from towerflow import _log
from towerflow.cluster import server as _server
from towerflow.cluster.link import shm_link as _shm_link
from towerflow.cluster.link import shm_ring as _shm_ring
from towerflow.cluster.calls import endpoint as _calls
from towerflow.cluster.calls.names import call_name
from towerflow.errors import ParameterServerError
from towerflow.ps.messages import CreateShards, PartMoved, PushPull, PushPulled, RowRead
from towerflow.ps.replication_messages import (PROMOTED, DropOp, MirrorState, ReplicaFrame, SeedOp, backup_of, is_part_key,
                                               move_key, part_key, ps_hosts, unreplicated_key)
from towerflow.ps.server import linked as _linked
from towerflow.ps.server.replication import mirror_link as _mirror_link
from towerflow.ps.server.replication import snapshot as _snapshot
from towerflow.ps.server.replication import to_backup as _to_backup
from towerflow.ps.server.replication.mirror import Mirror
from towerflow.ps.policies import make_policy
from towerflow.ps.server.replies import UNREPLICATED
from towerflow.ps.server.service import ShardService
from towerflow.ps.tables.table_shards import TableShards


@functools.lru_cache(maxsize=None)
def endpoint(name: str) -> Callable:
    """The call `name` (`messages.Endpoints`): `ServedModels.<name>` run on this task's `ServedModels`."""
    method = getattr(ServedModels, name)

    @functools.wraps(method)  # its `deferred` mark with it
    def on_this_task(*args: Any, **kwargs: Any) -> Any:
        return method(_calls.served(ServedModels, _for_this_task), *args, **kwargs)

    return on_this_task


def served_here(server: _server.Server) -> "ServedModels":
    """This ps task's `ServedModels`, made for `server` unless a call has made it already."""
    return _calls.served(ServedModels, lambda: ServedModels(server))


def _for_this_task() -> "ServedModels":
    return ServedModels(_server.current())


class ServedModels:
    """What one ps task serves: its models' services, the gates at which workers wait for them, and the mirrors
    of other ps tasks' parts it holds; its public methods are the calls workers (and other ps tasks) make."""

    def __init__(self, server) -> None:
        self._server = server  # this task's Server: its name, its place in the cluster, the store, the membership
        self._services: Dict[str, ShardService] = {}
        self._ready: Dict[str, List[torch.futures.Future]] = collections.defaultdict(list)
        self._opened: set = set()  # models the chief has initialized; workers start only then
        # After a lost ps: the restarted ps incarnations (call names) the chief has restored every ps task for, by
        # model, and the rejoins waiting for that. A surviving ps is open all along, so without this gate a worker
        # could read its clock there before the chief put it back to the checkpoint.
        self._restored: Dict[str, set] = collections.defaultdict(set)
        self._restore_waits: Dict[tuple, List[torch.futures.Future]] = collections.defaultdict(list)
        self._mirrors: Dict[tuple, Mirror] = {}  # (model, primary task) -> this task's mirror of that primary's part
        self._dropped: set = set()  # (part key, primary task, sender): feeds of mirrors dropped here (`_drop_mirror`)
        self._lock = threading.Lock()

    def services(self) -> Dict[str, ShardService]:
        """The models this ps process serves, by name (a copy: for the metrics recorder)."""
        with self._lock:
            return dict(self._services)

    def _get(self, model: str) -> ShardService:
        service = self._services.get(model)
        if service is None:
            if is_part_key(model):  # a part this task served while promoted, given back since
                raise PartMoved(f"this ps task no longer serves {model!r}: its primary is back")
            raise ParameterServerError(
                f"this ps holds no model {model!r} (it has {sorted(self._services)}); the chief creates it in "
                "strategy.setup() — was this ps restarted after the chief set it up?"
            )
        return service

    def create(self, model: str, request: CreateShards) -> int:
        """Hold the model's shards here, with the policy built here from the request's spec (a second
        create keeps what exists); load `request.state` when given, and with `open_now` let the
        workers in; with `request.snapshot` (a lost primary's mirror) put that back instead of `state`; with
        `request.backup_task`, replicate to that ps task (seeding it now). Returns the global step."""
        with self._lock:
            if model not in self._services:
                tables = (TableShards(request.task, request.tables, request.row_optimizer, request.table_values)
                          if request.tables else None)
                self._services[model] = ShardService(request.shards, request.values, request.optimizer_cls,
                                                     request.optimizer_settings, make_policy(request.policy),
                                                     request.policy.num_workers, tables)
            service = self._services[model]
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
            self.open_model(model)
        for incarnation in request.restored_for:
            self._mark_restored(model, incarnation, step)
        return step

    def _mirror(self, model: str, primary: int) -> Mirror:
        with self._lock:
            mirror = self._mirrors.get((model, primary))
            if mirror is None:
                mirror = self._mirrors[(model, primary)] = Mirror(model, primary)
        return mirror

    @_calls.deferred
    def replicate(self, frame: ReplicaFrame) -> torch.futures.Future:
        """A primary's op for the mirror of its part held here (`mirror.py`): a future of the last op number it holds
        in order (the primary's acknowledgement)."""
        feed = (frame.model, frame.primary, frame.sender)
        if isinstance(frame.op, SeedOp):
            self._dropped.discard(feed)  # the same backup serving the part again, promoted anew
        elif isinstance(frame.op, DropOp) or feed in self._dropped:
            return self._drop_mirror(frame)
        mirror = self._mirror(frame.model, frame.primary)
        if isinstance(frame.op, SeedOp) and not mirror.stands_in_for(frame.sender):
            # a new primary incarnation: a part served here in its place is over
            self._stop_serving(frame.model, frame.primary)
        return mirror.receive(frame)

    def _drop_mirror(self, frame: ReplicaFrame) -> torch.futures.Future:
        """The promoted backup `frame.sender` gave the part back (`DropOp`), or sends late after it did: let go of the
        mirror it fed here; its later frames are refused."""
        future: torch.futures.Future = torch.futures.Future()
        key = (frame.model, frame.primary)
        with self._lock:
            self._dropped.add((*key, frame.sender))
            mirror = self._mirrors.get(key)
        if mirror is not None and mirror.drop(frame.sender):
            with self._lock:
                if self._mirrors.get(key) is mirror:
                    del self._mirrors[key]
            _log.get("ps", self._server.name).info(f"drops its mirror of /job:ps/task:{frame.primary}'s part of "
                                                   f"{frame.model!r}: {frame.sender}, which fed it, gave the part back")
        if isinstance(frame.op, DropOp):
            future.set_result(frame.seq)
        else:
            future.set_exception(ParameterServerError(f"{frame.sender} gave /job:ps/task:{frame.primary}'s part of "
                                                      f"{frame.model!r} back: this task mirrors it for it no more"))
        return future

    def attach_mirror_link(self, model: str, primary: int, offer: _shm_link.LinkOffer,
                           ring: Optional[_shm_ring.RingOffer] = None, sender: str = "") -> bool:
        """Take the pushes of ps task `primary` (the incarnation `sender`) for its mirror here through its shared-memory
        link and ring (`mirror_link.py`); False when their files are not on this host."""
        mirror = self._mirror(model, primary)
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

    def mirror_state(self, model: str, primary: int) -> MirrorState:
        """This task's mirror of ps task `primary`'s part of the model, whole (the chief restores a lost primary from it);
        a part served here while promoted is given back first (`served` says so): later calls to it raise PartMoved."""
        mirror = self._stop_serving(model, primary)
        if mirror is not None:
            return dataclasses.replace(mirror.state(), served=True)
        with self._lock:
            mirror = self._mirrors.get((model, primary))
        return mirror.state() if mirror is not None else MirrorState(None, None, 0)

    def _mirrors_of(self, model: str, primary: int) -> List[Mirror]:
        """This task's mirrors of ps task `primary`'s part: fed by that task (under `model`), or by a backup that served
        the part while promoted (under its `part_key`). Under `_lock`."""
        held = (self._mirrors.get((model, primary)), self._mirrors.get((part_key(model, primary), primary)))
        return [m for m in held if m is not None]

    def promote(self, model: str, primary: int, lost: str) -> bool:
        """Serve ps task `primary`'s part of the model here, under `part_key`, in place of `lost`, the lost incarnation
        that served it (its primary, or a backup promoted before), from this task's mirror of it, and replicate it on
        to the next ps task: True once served (a second worker's call finds it so), False when no mirror here can stand
        for `lost` (fed by another incarnation, or `lost` said it went on without it)."""
        key = part_key(model, primary)
        with self._lock:
            if key in self._services:
                return True
            mirror = next((m for m in self._mirrors_of(model, primary) if m.fed_by == lost), None)
        service = mirror.promote(lost) if mirror is not None else None
        if service is None:
            return False
        server = self._server
        if move_key(server.swap, unreplicated_key(mirror.model, lost), PROMOTED, ("", "0")) != PROMOTED:
            mirror.retire()  # `lost` answered workers without this mirror first
            return False
        with self._lock:
            if key in self._opened:
                return True  # two workers asked at once: the other call serves it, and says so
            self._services.setdefault(key, service)
            self._opened.add(key)
        me = call_name("ps", server.task_index, server.incarnation)
        server.membership.stand_in("ps", primary, me)  # nobody waits for `lost` now: its host may never return
        _log.get("ps", server.name).info(f"promoted its mirror of /job:ps/task:{primary}'s part of {model!r} (in place "
                                         f"of {lost}) at global step {service.coordinator.global_step}")
        onward = backup_of(server.task_index, ps_hosts(server.cluster))
        if onward != primary and ("ps", onward) not in server.membership.stood_in():  # else no other task is left for it
            # the same settings as its own part
            own = self._services[model].replica if model in self._services else UNREPLICATED
            _to_backup.replicate(key, primary, service, onward, reseed=False, serving=server.task_index,
                                 max_lag=own.max_lag, own_push=own.own_push)
        return True

    def _stop_serving(self, model: str, primary: int) -> Optional[Mirror]:
        """Give back the part of `primary` served here while promoted, if it is; the mirror it was served from."""
        key = part_key(model, primary)
        with self._lock:
            served = self._services.pop(key, None)
            self._opened.discard(key)
            mirrors = self._mirrors_of(model, primary)
        mirror = next((m for m in mirrors if m.promoted), None)
        if served is not None:
            served.replica.retire()  # its onward backup lets go of the mirror it held of the part
        if served is None or mirror is None or not mirror.retire():
            return None
        server = self._server
        server.membership.stand_in("ps", primary, None)  # (its new incarnation said so as it joined, unless promoted after)
        _log.get("ps", server.name).info(f"gives /job:ps/task:{primary}'s part of {model!r} back at global "
                                         f"step {served.coordinator.global_step}")
        return mirror

    def holds(self, model: str) -> bool:
        """Whether this ps task holds its part of the model (a restarted one does not, until it is restored)."""
        with self._lock:
            return model in self._services

    def _mark_restored(self, model: str, incarnation: str, step: int) -> None:
        with self._lock:
            self._restored[model].add(incarnation)
            waiting = self._restore_waits.pop((model, incarnation), [])
        for f in waiting:
            f.set_result(step)

    def _after_restore(self, model: str, incarnation: str) -> torch.futures.Future:
        """A future that completes once the chief has restored this ps task after the loss of `incarnation`'s predecessor."""
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if incarnation not in self._restored[model]:
                self._restore_waits[(model, incarnation)].append(future)
                return future
        future.set_result(0)
        return future

    def open_model(self, model: str) -> int:
        """The chief has initialized (or restored) the model here: workers waiting for it may start."""
        with self._lock:
            service = self._get(model)
            self._opened.add(model)
            waiting = self._ready.pop(model, [])
            step = service.coordinator.global_step
        for f in waiting:
            f.set_result(step)
        return step

    @_calls.deferred
    def wait_ready(self, model: str) -> torch.futures.Future:
        """A future of the global step, done once the chief has created and initialized the model here."""
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if model in self._opened:
                step = self._services[model].coordinator.global_step
            else:
                self._ready[model].append(future)
                return future
        future.set_result(step)
        return future

    @_calls.deferred
    def rejoin(self, model: str, worker: int, restarted: bool = True, wait_open: bool = True,
               after_restore_of: Optional[str] = None) -> torch.futures.Future:
        """A worker goes on after a loss (its own restart, or a ps restored from a checkpoint): a future of
        `Rejoined`, so its clock agrees with the ps's; `wait_open`: first wait until the chief opened it;
        `after_restore_of`: first wait until the chief restored this task after that ps incarnation came back."""
        if after_restore_of is not None:
            restored = self._after_restore(model, after_restore_of)
            return restored.then(lambda _f: self._get(model).rejoin(worker, restarted))
        if not wait_open:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(self._get(model).rejoin(worker, restarted))
            return future
        return self.wait_ready(model).then(lambda _f: self._get(model).rejoin(worker, restarted))

    @_calls.deferred
    def pull(self, model: str, worker: int, clock: int, after_step: int = 0) -> torch.futures.Future:
        """A future of `Pulled` for the worker's step `clock`; it waits while the policy holds the worker back."""
        return self._get(model).pull(worker, clock, after_step)

    @_calls.deferred
    def push_pull(self, model: str, request: PushPull) -> torch.futures.Future:
        """One training step in one round trip: a future of `PushPulled`."""
        return self._get(model).push_pull(request)

    @_calls.deferred
    def push_pull_flat(self, model: str, *request: Any) -> torch.futures.Future:
        """`push_pull` of a dense step sent as plain values (`PushPull.flat`): a future of the reply's (`PushPulled.flat`)."""
        return _linked.mapped(self._get(model).push_pull(PushPull.from_flat(request)), PushPulled.flat)

    def attach_link(self, model: str, worker: int, offer: _shm_link.LinkOffer) -> bool:
        """Serve `worker`'s push-pulls of the model through its shared-memory link (it is on this host); False when
        the link's files are not here (the worker keeps remote calls)."""
        self._get(model)
        return _shm_link.serve(offer, _linked.handler(lambda: self._get(model)),
                               name=f"towerflow-link-{model}-{worker}", after=lambda: self._settle(model))

    def _settle(self, model: str) -> None:
        """A link thread's work after each reply (`Replicator.settle`); nothing when the model is no longer served here
        (the worker's next call says so)."""
        service = self._services.get(model)
        if service is not None:
            service.replica.settle()

    @_calls.deferred
    def read_rows(self, model: str, request: RowRead) -> torch.futures.Future:
        """A future of the table rows a worker's batch looks up here, one tensor per table of the request (a read
        that admitted hash ids answers once the backup has the admission too)."""
        service = self._get(model)
        rows = service.read_rows(request)
        if service.tables.needs_lock(request.tables):
            return service.replica.settled(rows)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(rows)
        return done

    @_calls.deferred
    def finish(self, model: str, worker: int, pushes_sent: Optional[int] = None) -> torch.futures.Future:
        """The worker is done once its `pushes_sent` pushes have arrived: a future of the global step."""
        return self._get(model).finish(worker, pushes_sent)

    @_calls.deferred
    def wait_finished(self, model: str) -> torch.futures.Future:
        """A future of the final global step, done when every worker has finished."""
        return self._get(model).when_all_finished()

    def metrics(self, model: str) -> dict:
        """This ps task's counters for the model (with the mirrors of other tasks' parts it holds, promoted ones' too)."""
        out = self._get(model).metrics()
        with self._lock:
            mirrors = [m for (name, _), m in self._mirrors.items() if name == model or name.startswith(model + "@")]
        if mirrors:
            out["mirrors"] = [m.metrics() for m in mirrors]
        return out

    def state(self, model: str) -> dict:
        """A checkpoint of this ps task's part of the model (values, optimizer state, step, clocks)."""
        return self._get(model).state_dict()

    def load_state(self, model: str, state: dict, finished: Sequence[int] = ()) -> int:
        """Put a `state()` back; returns the restored global step."""
        return self._get(model).load_state_dict(state, finished)

    def values(self, model: str) -> Dict[str, torch.Tensor]:
        """Copies of this ps task's shards, by shard name."""
        return {k: v.clone() for k, v in self._get(model).values().items()}

    def table_values(self, model: str) -> Dict[str, torch.Tensor]:
        """This ps task's shard of every fixed table of the model, by table name."""
        service = self._get(model)
        return service.tables.values() if service.tables else {}
