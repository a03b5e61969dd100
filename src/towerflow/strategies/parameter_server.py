"""Parameter-server training: variables on the ps tasks, gradients computed on the workers.

TF 1.x's between-graph replication with `replica_device_setter`, for PyTorch:

    strategy = towerflow.strategy_from_env()       # a cluster with a ps job selects this
    model, optimizer = strategy.setup(model, torch.optim.Adagrad(model.parameters(), lr=0.8))
    ... optimizer.zero_grad(); loss.backward(); optimizer.step() ...

`setup` places the variables on the ps tasks (`ps/layout.py`); the chief sends their first
values and the optimizer's type and settings, and the ps tasks own the optimizer state from
then on. Each `optimizer.step()` packs this worker's gradients into one flat buffer per ps
task (reused, no per-element Python), pushes them to every ps at once, and pulls the new
values back into the model; how pushes become updates is the mode (`ps/policies.py`).
With `prefetch=True` (async and ssp) the next values are pulled while the worker computes.

A ps task that builds this strategy serves its shards until every task is done, then exits
(so one script runs on every task); scripts in the seeds' style call `server.join()` instead.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from towerflow.cluster import server as _server
from towerflow.cluster import transport as _transport
from towerflow.errors import ParameterServerError, StrategyError
from towerflow.ps import service as _service
from towerflow.ps.layout import Layout, Partition, plan_layout
from towerflow.ps.policies import Ticket, make_policy
from towerflow.strategies._devices import default_device, resolve_device
from towerflow.strategies.base import Strategy
from towerflow.strategies.environment import ENV_DEVICE, register_strategy

ENV_MODE = "TOWERFLOW_PS_MODE"  # async | sync | ssp (towerflow launch --mode)
ENV_REPLICAS_TO_AGGREGATE = "TOWERFLOW_PS_REPLICAS_TO_AGGREGATE"
ENV_STALENESS = "TOWERFLOW_PS_STALENESS"


def _env_int(name: str) -> Optional[int]:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise StrategyError(f"{name}={text!r} in the environment: expected an integer") from None


def _share_cpus(cluster) -> None:
    """Tasks that share this host's CPUs split its cores (3 tasks x all cores each thrash on a laptop)."""
    from towerflow.cluster.spec import _same_place, split_address

    local = [a for j in cluster.jobs for a in cluster.job_tasks(j) if _same_place(split_address(a)[0]) == "127.0.0.1"]
    if len(local) > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(local)))


class _Channel:
    """This worker's link to one ps task: which parameter pieces go there, reused push buffers, its ticket."""

    def __init__(self, task: int, layout: Layout, params: Dict[str, torch.nn.Parameter], device: torch.device,
                 to: Optional[str] = None):
        self.task = task
        self.to = to or _server.rpc_name("ps", task)  # the ps task's RPC name (its current incarnation's)
        self.shards = layout.on_task(task)
        sizes = layout.flat_sizes(task)
        self.dtypes = list(sizes)
        pin = device.type == "cuda"
        # two sets of push buffers: one may still be on the wire while the other is filled
        self.buffers = [[torch.empty(sizes[d], dtype=d, pin_memory=pin) for d in self.dtypes] for _ in range(2)]
        self.staging = [torch.empty(sizes[d], dtype=d, device=device) for d in self.dtypes] if pin else None
        self.params = [params[s.variable] for s in self.shards]
        self.ticket = Ticket(0)
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers[0])

    def _piece(self, s, t: torch.Tensor) -> torch.Tensor:
        return t[s.row_start:s.row_stop] if s.is_partitioned else t

    def gather(self, k: int) -> List[torch.Tensor]:
        """Pack this task's gradient pieces into push buffer set k (one cat per dtype)."""
        out = []
        for i, d in enumerate(self.dtypes):
            srcs = []
            for s, p in zip(self.shards, self.params):
                if s.dtype == d:
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    srcs.append(self._piece(s, g).reshape(-1))
            if self.staging is None:
                torch.cat(srcs, out=self.buffers[k][i])
            else:
                torch.cat(srcs, out=self.staging[i])
                self.buffers[k][i].copy_(self.staging[i])
            out.append(self.buffers[k][i])
        return out

    @torch.no_grad()
    def install(self, ticket: Ticket, flats: List[torch.Tensor], device: torch.device) -> None:
        """Put pulled values into the model's parameters.

        On the CPU a whole (unpartitioned) variable is re-pointed at its slice of the received
        buffer, which the transport allocated for this pull anyway: no copy. Row shards, and
        every variable on a GPU, are copied (one foreach copy per call).
        """
        self.ticket = ticket
        by_dtype = dict(zip(self.dtypes, flats))
        if device.type != "cpu":
            by_dtype = {d: f.to(device, non_blocking=True) for d, f in by_dtype.items()}
        dsts, srcs = [], []
        for s, p in zip(self.shards, self.params):
            src = by_dtype[s.dtype][s.offset:s.offset + s.numel].view(s.shape)
            if device.type == "cpu" and not s.is_partitioned:
                p.data = src
            else:
                dsts.append(self._piece(s, p.data))
                srcs.append(src)
        if dsts:
            torch._foreach_copy_(dsts, srcs)


@register_strategy
class ParameterServerStrategy(Strategy):
    """Variables and optimizer on the ps tasks; workers pull, compute gradients on their device, push."""

    name = "parameter_server"

    def __init__(
        self,
        mode: Optional[str] = None,
        replicas_to_aggregate: Optional[int] = None,
        staleness: Optional[int] = None,
        staleness_aware_lr: bool = False,
        placement: str = "round_robin",
        partition: Partition = None,
        prefetch: bool = False,
        device: Optional[str] = None,
        server: Optional["_server.Server"] = None,
        model_name: str = "model",
        serve_ps: bool = True,
    ):
        self._owns_server = server is None and _server.current() is None
        self.server = server or _server.current() or _server.Server()
        cluster = self.server.cluster
        if "ps" not in cluster.jobs:
            raise StrategyError(
                f"the cluster {cluster.as_dict()} has no 'ps' job; launch with `towerflow launch --ps 1 --workers N` "
                "or train with all-reduce (strategy 'multi_worker_mirrored')"
            )
        if self.server.job_name == "ps":
            if serve_ps:
                self.server.join()  # serve shards until every task is done
                sys.exit(0)
            raise StrategyError(f"{self.server.name} is a ps task: it serves variables (server.join()) and trains nothing")
        replicas = [(t.job, t.task) for t in cluster.replicas()]
        here = (self.server.job_name, self.server.task_index)
        if here not in replicas:
            raise StrategyError(f"{self.server.name} is neither chief nor worker; only those train with parameter servers")
        if device is None:
            device = os.environ.get(ENV_DEVICE) or None
        torch_device, device_name = resolve_device(device) if device is not None else default_device()
        super().__init__(torch_device, device_name, num_replicas=len(replicas), replica_id=replicas.index(here))
        if torch_device.type == "cuda":
            torch.cuda.set_device(torch_device)
        elif "OMP_NUM_THREADS" not in os.environ:
            _share_cpus(cluster)
        self.mode = mode or os.environ.get(ENV_MODE) or "async"
        if replicas_to_aggregate is None:
            replicas_to_aggregate = _env_int(ENV_REPLICAS_TO_AGGREGATE)
        if staleness is None:
            staleness = _env_int(ENV_STALENESS)
        self.policy = make_policy(
            self.mode, num_workers=len(replicas), replicas_to_aggregate=replicas_to_aggregate,
            staleness=staleness, staleness_aware_lr=staleness_aware_lr,
        )
        if prefetch and self.mode == "sync":
            raise ParameterServerError(
                "prefetch=True with mode='sync': a sync worker must wait for the aggregated update before it pulls; "
                "drop prefetch or use mode='async' / 'ssp'"
            )
        self.prefetch = prefetch
        self.placement = placement
        self.partition = partition
        self.model_name = model_name
        self.num_ps = cluster.num_tasks("ps")
        self.layout: Optional[Layout] = None
        self._channels: List[_Channel] = []
        self._pushes = 0
        self._pending: Optional[List[Any]] = None  # prefetch: the push-pulls of the last step, not installed yet
        self._finished = False
        # measurement
        self._bytes_pushed: Dict[int, int] = collections.Counter()
        self._bytes_pulled: Dict[int, int] = collections.Counter()
        self._staleness: Dict[int, int] = collections.Counter()
        self._outcomes: Dict[str, int] = collections.Counter()
        self._started: Optional[float] = None
        self._pull_wait_s = 0.0

    # ---- model and optimizer
    def setup(self, model, optimizer=None, lr_schedule: Optional[Callable[[int], float]] = None,
              clip_grad_norm: Optional[float] = None):
        """Place the variables on the ps tasks (the chief sends their values), pull them, wrap the optimizer."""
        if optimizer is None:
            raise StrategyError("ParameterServerStrategy.setup needs the optimizer: the ps tasks run it")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise StrategyError(f"clip_grad_norm={clip_grad_norm!r}: expected a positive number or None")
        model = model.to(self.device)
        params = dict(model.named_parameters())
        groups = optimizer.param_groups
        if len(groups) != 1 or {id(p) for p in groups[0]["params"]} != {id(p) for p in params.values()}:
            raise ParameterServerError(
                "the ps runs one optimizer over all the model's parameters: build it as "
                "Optimizer(model.parameters(), ...) with a single parameter group"
            )
        _service.check_optimizer(type(optimizer))
        settings = {k: v for k, v in groups[0].items() if k != "params"}
        self.layout = plan_layout(params, self.num_ps, self.placement, self.partition)
        self._channels = [_Channel(t, self.layout, params, self.device, self.server.rpc_name_of("ps", t))
                          for t in range(self.num_ps) if self.layout.on_task(t)]
        rejoined = None
        if self.is_chief and self.server.incarnation == 0:
            futures = [
                _transport.call_async(ch.to, _service._rpc_create, args=(
                    self.model_name, ch.shards, self.layout.pack(ch.task, params), type(optimizer), settings,
                    self.policy, self.num_replicas_in_sync))
                for ch in self._channels
            ]
        elif self.server.incarnation > 0:  # restarted: go on from the ps's step, with the clock its pushes set
            futures = [_transport.call_async(ch.to, _service._rpc_rejoin, args=(self.model_name, self.replica_id))
                       for ch in self._channels]
            rejoined = [f.wait() for f in futures]
            self._pushes = max((p for _, p in rejoined), default=0)
        else:
            futures = [_transport.call_async(ch.to, _service._rpc_wait_ready, args=(self.model_name,)) for ch in self._channels]
        for f in futures:
            f.wait()
        self._install(self._pull(clock=self._pushes))
        if rejoined is not None:
            self._say_rejoined()
        self._started = time.perf_counter()
        wrapped = _PSOptimizer(optimizer, self, list(params.values()), lr_schedule, clip_grad_norm)
        return model, wrapped

    def _say_rejoined(self) -> None:
        """Log the recovery: where the restarted worker goes on, what was lost, how long it was down."""
        from towerflow.cluster import environment as _env

        died = os.environ.get(_env.ENV_RESTARTED_AT)
        down = f"; down {time.time() - float(died):.2f} s from its death to rejoining" if died else ""
        print(
            f"towerflow: {self.server.name} rejoined training (restart {self.server.incarnation}) at global step "
            f"{self.global_step}; the ps kept its {self._pushes} earlier pushes; lost: the gradient it was computing "
            f"and its place in its data{down}",
            file=sys.stderr, flush=True,
        )

    def _on_batch(self, batch) -> None:
        # Each worker's gradient is the mean over its own batch: the ps averages (sync) or applies it as is.
        self.last_batch = batch
        self.batch_weight = 1.0
        self._batch_is_empty = len(batch.indices) == 0

    # ---- the wire
    def _pull(self, clock: int, after_step: Optional[Dict[int, int]] = None) -> List[Any]:
        return [
            _transport.call_async(ch.to, _service._rpc_pull, args=(
                self.model_name, self.replica_id, clock, (after_step or {}).get(ch.task, 0)))
            for ch in self._channels
        ]

    def _install(self, futures: List[Any]) -> None:
        """Wait for pulls (or push-pulls) and copy their values into the model."""
        t0 = time.perf_counter()
        for ch, f in zip(self._channels, futures):
            result = f.wait()
            if len(result) == 3:  # a push-pull: (outcome, ticket, values)
                kind, staleness, _ = result[0]
                self._outcomes[kind] += 1
                if kind != "dropped":
                    self._staleness[staleness] += 1
                result = result[1:]
            ticket, flats = result
            ch.install(ticket, flats, self.device)
            self._bytes_pulled[ch.task] += ch.nbytes
        self._pull_wait_s += time.perf_counter() - t0
        self.global_step = self._channels[0].ticket.step if self._channels else 0

    def _push_and_pull(self, lr: Optional[float]) -> None:
        """One push-pull call per ps task, all in flight at once; with prefetch, install the previous one's values."""
        k = self._pushes % 2  # push buffer set k was last used two steps ago, and that call has been waited for
        self._pushes += 1
        clock = self._pushes + (1 if self.prefetch else 0)  # the step the returned values will compute
        calls = []
        for ch in self._channels:
            after = ch.ticket.step + 1 if self.mode == "sync" else 0  # sync: come back after the aggregated update
            calls.append(_transport.call_async(ch.to, _service._rpc_push_pull, args=(
                self.model_name, self.replica_id, ch.ticket, ch.gather(k), lr, clock, after)))
            self._bytes_pushed[ch.task] += ch.nbytes
        if not self.prefetch:
            self._install(calls)
        elif self._pending is None:  # first step: nothing fetched ahead yet; compute once more on these values
            self._pending = calls
        else:
            previous, self._pending = self._pending, calls
            self._install(previous)

    # ---- measurement
    def metrics(self) -> dict:
        """This worker's view: steps/s, bytes pushed and pulled per ps task, staleness of its pushes."""
        elapsed = time.perf_counter() - self._started if self._started else 0.0
        ps = lambda counts: {f"/job:ps/task:{t}": n for t, n in sorted(counts.items())}  # noqa: E731
        return {
            "mode": self.policy.describe(),
            "worker": self.replica_id,
            "steps": self._pushes,
            "global_step": self.global_step,
            "steps_per_s": self._pushes / elapsed if elapsed > 0 else 0.0,
            "bytes_pushed": ps(self._bytes_pushed),
            "bytes_pulled": ps(self._bytes_pulled),
            "pushes_applied": self._outcomes["applied"],
            "pushes_held": self._outcomes["held"],
            "pushes_dropped": self._outcomes["dropped"],
            "staleness_histogram": dict(sorted(self._staleness.items())),
            "pull_wait_s": self._pull_wait_s,
        }

    def ps_metrics(self) -> Dict[str, dict]:
        """Each ps task's counters (global step, updates, dropped stale gradients, staleness, bytes per worker)."""
        futures = [(ch.task, _transport.call_async(ch.to, _service._rpc_metrics, args=(self.model_name,))) for ch in self._channels]
        return {f"/job:ps/task:{t}": f.wait() for t, f in futures}

    def variables(self) -> Dict[str, torch.Tensor]:
        """The current values on the ps tasks, reassembled per variable (for checks and checkpoints)."""
        futures = [_transport.call_async(ch.to, _service._rpc_values, args=(self.model_name,)) for ch in self._channels]
        by_shard: Dict[str, torch.Tensor] = {}
        for f in futures:
            by_shard.update(f.wait())
        return {v: self.layout.assemble(v, [by_shard[s.name] for s in self.layout.shards_of(v)]) for v in self.layout.variables}

    # ---- collectives: none between workers; each worker reports its own view
    def reduce(self, value: Any, op: str = "mean") -> torch.Tensor:
        """This worker's value: ps workers share no process group (evaluate on the chief)."""
        return super().reduce(value, op)

    def finish(self) -> None:
        """Say this worker is done (slower peers stop waiting for it); waits for its pushes first."""
        if self._finished or not self._channels:
            self._finished = True
            return
        self._finished = True
        # Finish first: a prefetched pull may wait on peers (ssp) that in turn wait on this worker.
        done = [_transport.call_async(ch.to, _service._rpc_finish, args=(self.model_name, self.replica_id, self._pushes))
                for ch in self._channels]
        if self._pending is not None:
            self._install(self._pending)  # its pushes count, and the model ends with the latest values
            self._pending = None
        for f in done:
            f.wait()

    def wait_for_workers(self, refresh: bool = True) -> int:
        """finish(), wait until every worker has finished, and (`refresh`) pull the final values into
        the model, for the chief's evaluation and checkpoint; returns the final global step."""
        self.finish()
        futures = [_transport.call_async(ch.to, _service._rpc_wait_finished, args=(self.model_name,)) for ch in self._channels]
        steps = [f.wait() for f in futures]
        if refresh and self._channels:
            self._install(self._pull(self._pushes))
        self.global_step = steps[0] if steps else self.global_step
        return self.global_step

    def shutdown(self) -> None:
        """finish(), then, when this strategy started the task's server, wait for the others and leave."""
        self.finish()
        if self._owns_server:
            self.server.join()

    def __repr__(self) -> str:
        return (f"ParameterServerStrategy(worker {self.replica_id} of {self.num_replicas_in_sync}, {self.num_ps} ps, "
                f"{self.policy.describe()}, on {self.device_name})")


class _PSOptimizer:
    """What `setup` returns: `step()` pushes this worker's gradients and pulls the new values."""

    def __init__(self, optimizer, strategy: ParameterServerStrategy, params, lr_schedule, clip_grad_norm):
        self.optimizer = optimizer  # the user's; its settings went to the ps, it never steps here
        self.strategy = strategy
        self.params = params
        self.lr_schedule = lr_schedule
        self.clip_grad_norm = clip_grad_norm
        self.scaler = None
        self.last_grad_norm: Optional[float] = None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def global_step(self) -> int:
        return self.strategy.global_step

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The ps tasks' state (values, optimizer state, global step), for a checkpoint."""
        st = self.strategy
        futures = [(ch.task, _transport.call_async(ch.to, _service._rpc_state, args=(st.model_name,))) for ch in st._channels]
        return {"global_step": st.global_step, "ps": {t: f.wait() for t, f in futures}}

    def load_state_dict(self, state: dict) -> None:
        """Put a checkpoint back on the ps tasks and pull it into the model; call before training resumes."""
        st = self.strategy
        parts = state.get("ps", {})
        missing = [ch.task for ch in st._channels if ch.task not in parts and str(ch.task) not in parts]
        if missing:
            raise ParameterServerError(f"the checkpoint has no state for ps tasks {missing}; it was saved with another layout")
        futures = [_transport.call_async(ch.to, _service._rpc_load_state, args=(
            st.model_name, parts.get(ch.task, parts.get(str(ch.task))))) for ch in st._channels]
        for f in futures:
            f.wait()
        st._install(st._pull(st._pushes))

    def step(self, closure=None) -> None:
        if closure is not None:
            raise StrategyError("step(closure) is not supported with parameter servers: call step() after backward()")
        if self.clip_grad_norm is not None:
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(
                [p for p in self.params if p.grad is not None], self.clip_grad_norm))
        lr = float(self.lr_schedule(self.strategy.global_step)) if self.lr_schedule is not None else None
        self.strategy._push_and_pull(lr)

    def __repr__(self) -> str:
        return f"_PSOptimizer({type(self.optimizer).__name__} on the ps, global_step={self.strategy.global_step})"
