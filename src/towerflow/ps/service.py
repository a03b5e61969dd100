"""The ps side: the shards one ps task holds, their optimizer, the global step, and the calls workers make.

A ps task keeps its shards in one flat tensor per dtype (offsets from the `Layout`), so a
push or a pull is one tensor per dtype on the wire and the optimizer runs once over the
flat tensor. Only elementwise optimizers are allowed (SGD, momentum, Adagrad, Adam, ...):
for them an update of a flat buffer is, element for element, the update a local optimizer
makes to each variable, so the optimizer state lives on the ps and is exact per shard.

Reads do not lock (TF's `use_locking=False`): a pull returns the live tensor, and in async
mode an update may land while it is being sent. Updates are applied one at a time.

The module-level `_rpc_*` functions are what workers call through `cluster.transport`;
they find this process's services by model name.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import torch

from towerflow.cluster import transport as _transport
from towerflow.errors import ParameterServerError
from towerflow.ps.coordinator import Coordinator, Go
from towerflow.ps.layout import ShardSpec
from towerflow.ps.policies import Apply, Drop, Hold, PullRequest, Ticket, UpdatePolicy

# Elementwise optimizers: the update of each element depends only on that element's history.
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adagrad", "Adam", "AdamW", "Adamax", "Adadelta", "RMSprop", "NAdam", "RAdam", "ASGD")


def check_optimizer(cls: Type[torch.optim.Optimizer]) -> None:
    """Refuse optimizers whose update of an element depends on other elements (LBFGS, Rprop-like norms)."""
    name = getattr(cls, "__name__", repr(cls))
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or name not in ELEMENTWISE_OPTIMIZERS:
        raise ParameterServerError(
            f"optimizer {name!r} cannot run on parameter servers: the ps applies updates shard by shard, which is exact "
            f"only for elementwise optimizers; use one of {', '.join(ELEMENTWISE_OPTIMIZERS)} from torch.optim"
        )


class ShardService:
    """One ps task's shards of one model: values, optimizer state, coordinator and counters."""

    def __init__(
        self,
        shards: Sequence[ShardSpec],
        values: Dict[torch.dtype, torch.Tensor],
        optimizer_cls: Type[torch.optim.Optimizer],
        optimizer_defaults: Dict[str, Any],
        policy: UpdatePolicy,
        num_workers: int,
    ):
        check_optimizer(optimizer_cls)
        self.shards = tuple(shards)
        self.dtypes: Tuple[torch.dtype, ...] = tuple(values)
        self.flats: List[torch.Tensor] = [values[d].detach().clone().contiguous() for d in self.dtypes]
        for d, f in zip(self.dtypes, self.flats):
            need = sum(s.numel for s in self.shards if s.dtype == d)
            if f.dtype != d or f.dim() != 1 or f.numel() != need:
                raise ParameterServerError(
                    f"initial value for {d} is {tuple(f.shape)} {f.dtype}; the layout needs a flat {need}-element {d} tensor"
                )
        self.optimizer = optimizer_cls(self.flats, **optimizer_defaults)
        self.coordinator = Coordinator(policy, num_workers)
        self._lock = threading.Lock()
        self._sum: Optional[List[torch.Tensor]] = None  # sync: running sum of held gradients (reused)
        self._summed = 0
        self._waiting: Dict[object, torch.futures.Future] = {}
        self._all_done: List[torch.futures.Future] = []
        self._finishing: Dict[int, Tuple[int, torch.futures.Future]] = {}  # finishes waiting for late pushes
        self._next_key = 0
        self.rejoins: Dict[int, int] = collections.Counter()  # restarted workers that came back, by worker
        self.bytes_in: Dict[int, int] = collections.Counter()
        self.bytes_out: Dict[int, int] = collections.Counter()
        self.started = time.monotonic()
        self._nbytes = sum(f.numel() * f.element_size() for f in self.flats)

    # ---- pulls
    def pull(self, worker: int, clock: int = 0, after_step: int = 0) -> torch.futures.Future:
        """A future of (ticket, flat values); it completes now or when the policy lets the worker go."""
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            key = self._next_key
            self._next_key += 1
            answer = self.coordinator.pull(PullRequest(worker, clock, after_step, key))
            if isinstance(answer, Go):
                result = self._reply(answer)
            else:
                self._waiting[key] = future
                result = None
        if result is not None:
            future.set_result(result)
        return future

    def _reply(self, go: Go) -> Tuple[Ticket, List[torch.Tensor]]:
        self.bytes_out[go.request.worker] += self._nbytes
        return go.ticket, self.flats

    # ---- pushes
    def push(self, worker: int, ticket: Ticket, grads: Sequence[torch.Tensor], lr: Optional[float] = None) -> Tuple[str, int, int]:
        """Apply, hold or drop a worker's gradients; returns (what happened, staleness, global step).

        `lr`, when given, is the learning rate from the worker's schedule; it stays set until the next one.
        """
        if len(grads) != len(self.flats) or any(g.shape != f.shape or g.dtype != f.dtype for g, f in zip(grads, self.flats)):
            raise ParameterServerError(
                f"worker {worker} pushed {[(tuple(g.shape), g.dtype) for g in grads]}; this ps holds "
                f"{[(tuple(f.shape), f.dtype) for f in self.flats]}. Every task must build the same model and layout."
            )
        with self._lock:
            self.bytes_in[worker] += sum(g.numel() * g.element_size() for g in grads)
            action = self.coordinator.push(worker, ticket)
            if lr is not None and not isinstance(action, Drop):
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            if isinstance(action, Hold):
                self._add_to_sum(grads)
            elif isinstance(action, Apply):
                if len(action.workers) > 1:
                    self._add_to_sum(grads)
                    self._apply(self._mean(len(action.workers)), action.lr_scale)
                else:
                    self._apply(grads, action.lr_scale)
            released = self._take_released()
            step = self.coordinator.global_step
            waiting_finish = self._finishing.get(worker)
            if waiting_finish is not None and self.coordinator.pushes_by_worker[worker] >= waiting_finish[0]:
                del self._finishing[worker]
                released += self._finish_locked(worker, waiting_finish[1])
        self._complete(released)
        kind = "dropped" if isinstance(action, Drop) else "held" if isinstance(action, Hold) else "applied"
        return kind, action.staleness, step

    def push_pull(self, worker: int, ticket: Ticket, grads: Sequence[torch.Tensor], lr: Optional[float],
                  clock: int, after_step: int) -> torch.futures.Future:
        """A push, then a pull, in one call (one round trip per step): a future of (outcome, ticket, values)."""
        outcome = self.push(worker, ticket, grads, lr)
        pulled = self.pull(worker, clock, after_step)
        return pulled.then(lambda f: (outcome,) + tuple(f.value()))

    def finish(self, worker: int, pushes_sent: Optional[int] = None) -> torch.futures.Future:
        """A worker is done; peers stop waiting for it. A future of the global step.

        `pushes_sent` is how many pushes the worker sent: calls can overtake each other, so the
        finish waits until that many have arrived (else a late push would come after the end).
        """
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if pushes_sent is not None and self.coordinator.pushes_by_worker[worker] < pushes_sent:
                self._finishing[worker] = (pushes_sent, future)
                return future
            released = self._finish_locked(worker, future)
        self._complete(released)
        return future

    def _finish_locked(self, worker: int, future: torch.futures.Future) -> list:
        action = self.coordinator.finish(worker)
        if action is not None:
            self._apply(self._mean(len(action.workers)), action.lr_scale)
        released = self._take_released()
        step = self.coordinator.global_step
        released.append((future, step))
        if not self.coordinator.active:
            released += [(f, step) for f in self._all_done]
            self._all_done = []
        return released

    def when_all_finished(self) -> torch.futures.Future:
        """A future of the global step that completes once every worker has called finish."""
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self.coordinator.active:
                self._all_done.append(future)
                return future
            step = self.coordinator.global_step
        future.set_result(step)
        return future

    def _add_to_sum(self, grads: Sequence[torch.Tensor]) -> None:
        if self._sum is None:
            self._sum = [torch.empty_like(f) for f in self.flats]  # allocated once, reused every step
        if self._summed == 0:
            torch._foreach_copy_(self._sum, list(grads))
        else:
            torch._foreach_add_(self._sum, list(grads))
        self._summed += 1

    def _mean(self, n: int) -> List[torch.Tensor]:
        if self._summed != n:
            raise ParameterServerError(f"internal: {self._summed} gradients summed for an update of {n}")
        torch._foreach_div_(self._sum, float(n))
        self._summed = 0
        return self._sum

    def _apply(self, grads: Sequence[torch.Tensor], lr_scale: float) -> None:
        for f, g in zip(self.flats, grads):
            f.grad = g
        saved = None
        if lr_scale != 1.0:
            saved = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * lr_scale
        self.optimizer.step()
        if saved is not None:
            for group, lr in zip(self.optimizer.param_groups, saved):
                group["lr"] = lr
        for f in self.flats:
            f.grad = None

    def _take_released(self):
        out = []
        for go in self.coordinator.released():
            future = self._waiting.pop(go.request.key, None)
            if future is not None:
                out.append((future, self._reply(go)))
        return out

    @staticmethod
    def _complete(released) -> None:
        for future, result in released:  # outside the lock: completing sends the reply
            future.set_result(result)

    def _check_rejoin(self, worker: int) -> bool:
        self.rejoins[worker] += 1
        return self.coordinator.rejoin(worker)

    # ---- checkpoints
    def state_dict(self) -> dict:
        """Values, optimizer state, global step and worker clocks, copied (a checkpoint of this ps task)."""
        import copy

        with self._lock:
            return {
                "shards": [sp.name for sp in self.shards],
                "values": [f.detach().clone() for f in self.flats],
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "global_step": self.coordinator.global_step,
                "clocks": dict(self.coordinator.clocks),
            }

    def load_state_dict(self, state: dict, finished: Sequence[int] = ()) -> int:
        """Put a `state_dict()` back (at the start, or after a ps was lost mid-training); returns the
        restored global step. Held gradients are dropped; waiting pulls get the restored values.
        `finished`: workers that had finished before (they will not push again)."""
        names = [sp.name for sp in self.shards]
        if state.get("shards") != names:
            raise ParameterServerError(
                f"the checkpoint holds shards {state.get('shards')}, this ps task holds {names}; restore with the same "
                "model, number of ps tasks, placement and partition as when it was saved"
            )
        with self._lock:
            for f, v in zip(self.flats, state["values"]):
                f.copy_(v)
            self.optimizer.load_state_dict(state["optimizer"])
            self._summed = 0
            clocks = state.get("clocks") or {}
            self.coordinator.restore(int(state["global_step"]), {int(w): int(c) for w, c in clocks.items()}, finished)
            released = self._take_released()
            step = self.coordinator.global_step
        self._complete(released)
        return step

    # ---- inspection
    def values(self) -> Dict[str, torch.Tensor]:
        """Each shard's current value by shard name (views of the flat buffers)."""
        flat = dict(zip(self.dtypes, self.flats))
        return {s.name: flat[s.dtype][s.offset:s.offset + s.numel].view(s.shape) for s in self.shards}

    def metrics(self) -> dict:
        with self._lock:
            out = self.coordinator.metrics()
        elapsed = max(1e-9, time.monotonic() - self.started)
        out.update(
            bytes_pushed_by_worker=dict(self.bytes_in),
            bytes_pulled_by_worker=dict(self.bytes_out),
            updates_per_s=out["applied_updates"] / elapsed,
            rejoins_by_worker=dict(self.rejoins),
            shards=[s.name for s in self.shards],
        )
        return out


def warm_up() -> None:
    """Build and drop a throwaway optimizer before serving.

    A process's first torch.optim optimizer imports torch._dynamo, seconds on a small machine. A ps
    task pays that while the workers build their models, not when the chief's first call creates the
    shards here with every worker waiting on it.
    """
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])


# ---- what workers call (through cluster.transport), one registry per ps process
_services: Dict[str, ShardService] = {}
_ready: Dict[str, List[torch.futures.Future]] = collections.defaultdict(list)
_opened: set = set()  # models the chief has initialized; workers start only then
_registry_lock = threading.Lock()


def _get(model: str) -> ShardService:
    service = _services.get(model)
    if service is None:
        raise ParameterServerError(
            f"this ps holds no model {model!r} (it has {sorted(_services)}); the chief creates it in strategy.setup() — "
            "was this ps restarted after the chief set it up?"
        )
    return service


def _rpc_create(model: str, shards, values, optimizer_cls, optimizer_defaults, policy, num_workers,
                state: Optional[dict] = None, finished: Sequence[int] = (), open_now: bool = False) -> int:
    """Create the model's shards here (the chief calls this; a second create keeps what exists),
    load `state` into them when given (a checkpoint), and with `open_now` let the workers in."""
    with _registry_lock:
        if model not in _services:
            _services[model] = ShardService(shards, values, optimizer_cls, optimizer_defaults, policy, num_workers)
        service = _services[model]
    step = service.load_state_dict(state, finished) if state is not None else service.coordinator.global_step
    if open_now:
        _rpc_open(model)
    return step


def _rpc_open(model: str) -> int:
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
def _rpc_wait_ready(model: str) -> torch.futures.Future:
    """Completes when the chief has created and initialized the model here (what the other workers wait on)."""
    future: torch.futures.Future = torch.futures.Future()
    with _registry_lock:
        if model in _opened:
            step = _services[model].coordinator.global_step
        else:
            _ready[model].append(future)
            return future
    future.set_result(step)
    return future


def _clock_of(model: str, worker: int, restarted: bool) -> Tuple[int, int, bool]:
    service = _get(model)
    with service._lock:
        finished = service._check_rejoin(worker) if restarted else worker not in service.coordinator.active
        return service.coordinator.global_step, service.coordinator.pushes_by_worker[worker], finished


@_transport.deferred
def _rpc_rejoin(model: str, worker: int, restarted: bool = True, wait_open: bool = True) -> torch.futures.Future:
    """A worker goes on after a loss (its own restart, or a ps restored from a checkpoint): a future of
    (global step, pushes this ps has from that worker, whether it had finished), so its clock agrees."""
    if not wait_open:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(_clock_of(model, worker, restarted))
        return future
    return _rpc_wait_ready(model).then(lambda _f: _clock_of(model, worker, restarted))


@_transport.deferred
def _rpc_pull(model: str, worker: int, clock: int, after_step: int) -> torch.futures.Future:
    return _get(model).pull(worker, clock, after_step)


@_transport.deferred
def _rpc_push_pull(model: str, worker: int, ticket: Ticket, grads: List[torch.Tensor], lr: Optional[float],
                   clock: int, after_step: int) -> torch.futures.Future:
    return _get(model).push_pull(worker, ticket, grads, lr, clock, after_step)


def _rpc_push(model: str, worker: int, ticket: Ticket, grads: List[torch.Tensor], lr: Optional[float] = None):
    return _get(model).push(worker, ticket, grads, lr)


@_transport.deferred
def _rpc_wait_finished(model: str) -> torch.futures.Future:
    return _get(model).when_all_finished()


@_transport.deferred
def _rpc_finish(model: str, worker: int, pushes_sent: Optional[int] = None) -> torch.futures.Future:
    return _get(model).finish(worker, pushes_sent)


def _rpc_metrics(model: str) -> dict:
    return _get(model).metrics()


def _rpc_state(model: str) -> dict:
    return _get(model).state_dict()


def _rpc_load_state(model: str, state: dict, finished: Sequence[int] = ()) -> int:
    return _get(model).load_state_dict(state, finished)


def _rpc_values(model: str) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _get(model).values().items()}
