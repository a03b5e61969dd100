"""The ps side: the shards one ps task holds, their optimizer, the global step, and the calls workers make.

A ps task keeps its shards in one flat tensor per dtype (offsets from the `Layout`), so a
push or a pull is one tensor per dtype on the wire and the optimizer runs once over the
flat tensor. Only elementwise optimizers are allowed (SGD, momentum, Adagrad, Adam, ...):
for them an update of a flat buffer is, element for element, the update a local optimizer
makes to each variable, so the optimizer state lives on the ps and is exact per shard.

A push carries gradients (`kind="grad"`, through the optimizer) or, from a local-steps (geo)
worker, the change of its parameters since its last pull (`kind="delta"`), which is added to
the values (sync: the mean of the aggregated deltas, model averaging; async and ssp: each
delta divided by the active workers) and never goes through the optimizer. A delta counts as one push for the coordinator. Every worker of a model
pushes the same kind: the first push fixes it.

Reads do not lock (TF's `use_locking=False`): a pull returns the live tensor, and in async
mode an update may land while it is being sent. Updates are applied one at a time.

Workers reach a `ShardService` through the public functions of `endpoints.py`, with the
requests and replies of `ps/messages.py`.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import torch

from towerflow.errors import ParameterServerError
from towerflow.ps.layout import ShardSpec
from towerflow.ps.server.coordinator import Coordinator, Go
from towerflow.ps.messages import (PUSH_KINDS, EarlierWorkers, Pulled, PushOutcome, PushPull, PushPulled, Rejoined,
                                   RowPush, RowRead, Ticket)
from towerflow.ps.elementwise import check_optimizer
from towerflow.ps.server.optimizers import unhooked_step
from towerflow.ps.policies import Apply, Drop, Hold, PullRequest, UpdatePolicy
from towerflow.ps.replication_messages import FinishOp, LoadStateOp, PushOp, RejoinOp, RowsReadOp
from towerflow.ps.server.replies import UNREPLICATED
from towerflow.ps.tables.table_shards import TableShards

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
        tables: Optional[TableShards] = None,
    ):
        check_optimizer(optimizer_cls)
        self.optimizer_cls = optimizer_cls
        self.shards = tuple(shards)
        self.dtypes: Tuple[torch.dtype, ...] = tuple(values)
        self.flats: List[torch.Tensor] = [values[d].detach().clone().contiguous() for d in self.dtypes]
        for d, f in zip(self.dtypes, self.flats):
            need = sum(s.numel for s in self.shards if s.dtype == d)
            if f.dtype != d or f.dim() != 1 or f.numel() != need:
                raise ParameterServerError(
                    f"initial value for {d} is {tuple(f.shape)} {f.dtype}; the layout needs a flat {need}-element {d} tensor"
                )
        # a ps task may hold only table shards: then there is no dense optimizer here
        self.optimizer = optimizer_cls(self.flats, **optimizer_defaults) if self.flats else None
        self._step = unhooked_step(self.optimizer) if self.optimizer else None
        self.tables = tables
        self.lr: Optional[float] = None  # the workers' lr schedule, for the tables' row optimizer
        self.coordinator = Coordinator(policy, num_workers)
        self._lock = threading.Lock()
        self.replica = UNREPLICATED  # replicator.py: each mutating call forwarded to the backup, replies after its ack
        self._sum: Optional[List[torch.Tensor]] = None  # sync: running sum of held gradients (reused)
        self._summed = 0
        self.push_kind: Optional[str] = None  # "grad" or "delta": fixed by the first push (every worker pushes alike)
        self._waiting: Dict[object, torch.futures.Future] = {}
        self._all_done: List[torch.futures.Future] = []
        self._finishing: Dict[int, Tuple[int, torch.futures.Future]] = {}  # finishes waiting for late pushes
        self._next_key = 0
        self.rejoins: Dict[int, int] = collections.Counter()  # restarted workers that came back, by worker
        self.reads: Dict[int, int] = {}  # the last RowRead.number counted, by worker (hash tables)
        self.bytes_in: Dict[int, int] = collections.Counter()
        self.bytes_out: Dict[int, int] = collections.Counter()
        self.started = time.monotonic()
        self._nbytes = sum(f.numel() * f.element_size() for f in self.flats)

    @property
    def lock(self) -> threading.Lock:
        """The lock every change of this service's state holds (a publisher takes its changed rows under it)."""
        return self._lock

    # ---- pulls
    def pull(self, worker: int, clock: int = 0, after_step: int = 0) -> torch.futures.Future:
        """A future of `Pulled`; it completes now or when the policy lets the worker go."""
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
            self.replica.deliver([(future, result, worker)])
        return future

    def read_rows(self, request: RowRead) -> List[torch.Tensor]:
        """The table rows a worker's batch looks up (under the lock when a hash table is read: it may admit ids)."""
        if not self.tables:
            raise ParameterServerError(f"worker {request.worker} read table rows {list(request.tables)} from a ps task "
                                       "that holds no tables; every task must build the same model")
        if self.tables.needs_lock(request.tables):
            with self._lock:
                again = 0 < request.number <= self.reads.get(request.worker, 0)  # counted before a restore
                if not again:
                    self.replica.forward(RowsReadOp(request))
                    self.reads[request.worker] = request.number
                out = self.tables.read(request.tables, request.local_keys(), self.coordinator.global_step,
                                       count=not again)
        else:  # fixed tables are read as the dense values are: without waiting for an update (use_locking=False)
            out = self.tables.read(request.tables, request.local_keys(), self.coordinator.global_step)
        self.bytes_in[request.worker] += request.nbytes
        self.bytes_out[request.worker] += sum(r.numel() * r.element_size() for r in out)
        return out

    def _reply(self, go: Go) -> Pulled:
        self.bytes_out[go.request.worker] += self._nbytes
        return Pulled(go.ticket, self.flats)

    # ---- pushes
    def push(self, worker: int, ticket: Ticket, grads: Sequence[torch.Tensor], lr: Optional[float] = None,
             rows: Optional[RowPush] = None, kind: str = "grad") -> PushOutcome:
        """Apply, hold or drop a worker's gradients (and its table rows, with them); says which, with the
        staleness and global step. A dropped push's rows are not applied either.

        `lr`, when given, is the learning rate from the worker's schedule; it stays set until the next one.
        `kind="delta"`: `grads` are a local-steps worker's parameter deltas, added to the values.
        """
        if len(grads) != len(self.flats) or any(g.shape != f.shape or g.dtype != f.dtype for g, f in zip(grads, self.flats)):
            raise ParameterServerError(
                f"worker {worker} pushed {[(tuple(g.shape), g.dtype) for g in grads]}; this ps holds "
                f"{[(tuple(f.shape), f.dtype) for f in self.flats]}. Every task must build the same model and layout."
            )
        with self._lock:
            self._check_kind(worker, kind, rows)
            self.bytes_in[worker] += sum(g.numel() * g.element_size() for g in grads) + (rows.nbytes if rows else 0)
            action = self.coordinator.push(worker, ticket)
            self.replica.forward(PushOp(worker, ticket, grads, lr, rows, kind))
            if lr is not None and not isinstance(action, Drop):
                self.lr = lr
                for group in self.optimizer.param_groups if self.optimizer else ():
                    group["lr"] = lr
            if isinstance(action, Hold):
                self._add_to_sum(grads)
                self._hold_rows(rows)
            elif isinstance(action, Apply):
                if len(action.workers) > 1:
                    self._add_to_sum(grads)
                    self._hold_rows(rows)
                    self._apply(self._mean(len(action.workers)), action.lr_scale, len(action.workers))
                else:
                    self._apply(grads, action.lr_scale, rows=rows)
            released = self._take_released()
            step = self.coordinator.global_step
            waiting_finish = self._finishing.get(worker)
            if waiting_finish is not None and self.coordinator.pushes_by_worker[worker] >= waiting_finish[0]:
                del self._finishing[worker]
                released += self._finish_locked(worker, waiting_finish[1])
        self._complete(released)
        kind = "dropped" if isinstance(action, Drop) else "held" if isinstance(action, Hold) else "applied"
        return PushOutcome(kind, action.staleness, step)

    def push_pull(self, request: PushPull) -> torch.futures.Future:
        """A push, then a pull, in one call (one round trip per step): a future of `PushPulled`."""
        outcome = self.push(request.worker, request.ticket, request.grads, request.lr, request.rows, request.kind)
        pulled = self.pull(request.worker, request.clock, request.after_step)
        if pulled.done():  # async, most ssp steps: no callback chain
            now: torch.futures.Future = torch.futures.Future()
            now.set_result(PushPulled(outcome, pulled.value()))
            return now
        return pulled.then(lambda f: PushPulled(outcome, f.value()))

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
        self.replica.forward(FinishOp(worker))
        action = self.coordinator.finish(worker)
        if action is not None:
            self._apply(self._mean(len(action.workers)), action.lr_scale, len(action.workers))
        released = self._take_released()
        step = self.coordinator.global_step
        released.append((future, step, None))
        if not self.coordinator.active:
            released += [(f, step, None) for f in self._all_done]
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

    def _check_kind(self, worker: int, kind: str, rows: Optional[RowPush]) -> None:
        """A push's kind is one of PUSH_KINDS, the one every earlier push had; a delta carries no table rows."""
        if kind not in PUSH_KINDS:
            raise ParameterServerError(f"worker {worker} pushed kind={kind!r}; expected one of {PUSH_KINDS}")
        if kind == "delta" and rows is not None:
            raise ParameterServerError(f"worker {worker} pushed a parameter delta with table rows; local steps "
                                       "(local_steps > 1) train no embedding tables: drop local_steps")
        if self.push_kind is None:
            self.push_kind = kind
        elif kind != self.push_kind:
            said = {"grad": "gradients (local_steps 1)", "delta": "parameter deltas (local_steps > 1)"}
            raise ParameterServerError(
                f"worker {worker} pushed {said[kind]}, but this ps has received {said[self.push_kind]}; every worker "
                "must train with the same local_steps (`towerflow launch --local-steps K` hands it to all)"
            )

    def _hold_rows(self, rows: Optional[RowPush]) -> None:
        if rows is not None and self.tables:
            self.tables.hold(rows.tables, rows.local_keys(), rows.grads)

    def _add_to_sum(self, grads: Sequence[torch.Tensor]) -> None:
        if not self.flats:
            self._summed += 1
            return
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
        if self.flats:
            torch._foreach_div_(self._sum, float(n))
        self._summed = 0
        return self._sum or []

    def _apply(self, grads: Sequence[torch.Tensor], lr_scale: float, held: int = 0,
               rows: Optional[RowPush] = None) -> None:
        """One update: the dense flats through the optimizer, then the tables' rows (this push's, or the
        `held` pushes' mean); the step after it is the coordinator's global step, which counted it."""
        if self.tables:
            step = self.coordinator.global_step
            if held:
                self.tables.apply_held(held, self.lr, lr_scale, step)
            elif rows is not None:
                self.tables.apply(rows.tables, rows.local_keys(), rows.grads, self.lr, lr_scale, step)
            self.tables.evict(step)
        if self.optimizer is None:
            return
        if self.push_kind == "delta":  # geo: the workers' optimizers already stepped; add what they did
            torch._foreach_add_(self.flats, list(grads), alpha=lr_scale * self._delta_weight())
            return
        for f, g in zip(self.flats, grads):
            f.grad = g
        saved = None
        if lr_scale != 1.0:
            saved = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * lr_scale
        self._step()
        if saved is not None:
            for group, lr in zip(self.optimizer.param_groups, saved):
                group["lr"] = lr
        for f in self.flats:
            f.grad = None

    def _delta_weight(self) -> float:
        """What one applied delta is multiplied by: sync applies the mean of the aggregated deltas already (1);
        async and ssp divide each worker's delta by the active workers, so that a round in which every worker
        pushed once adds the mean of their deltas, as sync does (model averaging; PaddlePaddle's geo divides by
        the trainers too). docs/parameter-server.md, "Local steps (geo)", has the measurements."""
        return 1.0 if self.coordinator.policy.aggregates else 1.0 / max(1, len(self.coordinator.active))

    def _take_released(self):
        out = []
        for go in self.coordinator.released():
            future = self._waiting.pop(go.request.key, None)
            if future is not None:
                out.append((future, self._reply(go), go.request.worker))
        return out

    def _complete(self, released) -> None:
        self.replica.deliver(released)  # outside the lock: completing sends the reply (once the backup has enough)

    def rejoin(self, worker: int, restarted: bool) -> Rejoined:
        """Where `worker` stands here after a loss; `restarted`: it is a new incarnation (counted, and
        told whether its earlier one had finished), else a ps was restored under it."""
        with self._lock:
            if restarted:
                self.replica.forward(RejoinOp(worker))
                self.rejoins[worker] += 1
                self.reads.pop(worker, None)  # a new incarnation numbers its reads from 1
                finished = self.coordinator.rejoin(worker)
            else:
                finished = worker not in self.coordinator.active
            return Rejoined(self.coordinator.global_step, self.coordinator.pushes_by_worker[worker], finished,
                            self.coordinator.earlier)

    # ---- checkpoints
    def state_dict(self) -> dict:
        """Values, optimizer state, global step, worker clocks and the worker counts restored from before them,
        copied (a checkpoint of this ps task)."""
        import copy

        with self._lock:
            return {
                "shards": [sp.name for sp in self.shards],
                "values": [f.detach().clone() for f in self.flats],
                "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer else None,
                "tables": copy.deepcopy(self.tables.state_dict()) if self.tables else {},
                "global_step": self.coordinator.global_step,
                "clocks": dict(self.coordinator.clocks),
                "earlier": [[e.num_workers, list(e.clocks)] for e in self.coordinator.earlier],
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
            self.replica.forward(LoadStateOp(state, tuple(finished)))
            for f, v in zip(self.flats, state["values"]):
                f.copy_(v)
            if self.optimizer is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            if self.tables:
                self.tables.load_state_dict(state.get("tables") or {})
            self._summed = 0
            clocks = state.get("clocks") or {}
            earlier = [EarlierWorkers(int(n), tuple(int(c) for c in counts)) for n, counts in state.get("earlier") or ()]
            self.coordinator.restore(int(state["global_step"]), {int(w): int(c) for w, c in clocks.items()}, finished,
                                     earlier)
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
            pulls=self._next_key,  # pull requests so far (answered or waiting)
            shards=[s.name for s in self.shards],
        )
        if self.replica.is_replicated:
            out["replication"] = self.replica.metrics()
        if self.tables:
            with self._lock:
                out["tables"] = self.tables.metrics()
        return out

