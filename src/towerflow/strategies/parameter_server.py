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
With `local_steps=k` (k > 1, geo-SGD) the optimizer steps on the worker and every k-th step
pushes the parameter delta instead (`ps/worker/local_steps.py`).
With `dense="allreduce"` only the embedding tables go to the ps tasks: the rest of the model is
replicated on the workers and all-reduced (`strategies/hybrid.py`, which this constructor returns then).

The ps tasks do not run this strategy: they serve (`towerflow launch` starts them as
`python -m towerflow.ps.serve`; scripts in the seeds' style call `server.join()` on them). The
work is in `ps/worker/`: `PSClient` makes the calls, `Recovery` survives a lost ps, `PSOptimizer` is
the optimizer `setup` returns; this module reads the task's settings and wires them together.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Dict, List, Optional

import torch

from towerflow import taskenv as _taskenv
from towerflow.cluster import server as _server
from towerflow.data.file_regroup import Resume
from towerflow.errors import ParameterServerError, StrategyError
from towerflow.ps.layout import Layout, Partition, plan_layout
from towerflow.ps.messages import PolicySpec
from towerflow.ps.replication_messages import check_ps_replicas, check_replica_lag
from towerflow.ps.policies import make_policy
from towerflow.ps.elementwise import check_optimizer
from towerflow.ps.tables import PARTITION_STRATEGIES
from towerflow.ps.tables.row_optimizers import RowOptimizer, row_optimizer_for
from towerflow.ps.worker import inspection
from towerflow.ps.worker.client import PSClient
from towerflow.ps.worker.file_position import resume_point
from towerflow.ps.worker.local_steps import check_local_steps
from towerflow.ps.worker.lookups import TableLookups, detach_rows, find_tables, table_spec
from towerflow.ps.worker.optimizer import PSOptimizer
from towerflow.ps.worker.recovery import Recovery
from towerflow.strategies._devices import default_device, resolve_device
from towerflow.strategies.base import Strategy

DENSE_PLACES = _taskenv.PS_DENSE  # where the dense (non-table) parameters train: on the ps tasks, or all-reduced


def dense_place(dense: Optional[str], task) -> str:
    """The `dense=` option, else the launch's `--dense` (TOWERFLOW_PS_DENSE), else 'ps'; checked."""
    value = dense if dense is not None else (task.ps.dense or "ps")
    if value not in DENSE_PLACES:
        raise StrategyError(f"dense={value!r}: expected one of {DENSE_PLACES} ('ps': every parameter on the ps tasks; "
                            "'allreduce': the tables on the ps tasks, the rest replicated on the workers and all-reduced)")
    return value


class ParameterServerStrategy(Strategy):
    """Variables and optimizer on the ps tasks; workers pull, compute gradients on their device, push."""

    name = "parameter_server"
    shared_variables = True
    dense = "ps"  # where the non-table parameters train ("allreduce": HybridStrategy)

    def __new__(cls, *args: Any, **kwargs: Any) -> "ParameterServerStrategy":
        if cls is ParameterServerStrategy:
            options = inspect.signature(cls.__init__).bind(None, *args, **kwargs).arguments
            server = options.get("server") or _server.current()
            task = server.context if server is not None else options.get("context") or _taskenv.from_environment()
            if dense_place(options.get("dense"), task) == "allreduce":
                from towerflow.strategies.hybrid import HybridStrategy  # a subclass: imported on use

                return super().__new__(HybridStrategy)
        return super().__new__(cls)

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
        partition_strategy: str = "mod",
        local_steps: Optional[int] = None,
        ps_replicas: Optional[int] = None,
        ps_replica_lag: Optional[int] = None,
        dense: Optional[str] = None,
        context: Optional["_taskenv.TaskContext"] = None,
    ):
        self._owns_server = server is None and _server.current() is None
        self.server = server or _server.current() or _server.Server(context=context)
        cluster = self.server.cluster
        if "ps" not in cluster.jobs:
            raise StrategyError(
                f"the cluster {cluster.as_dict()} has no 'ps' job; launch with `towerflow launch --ps 1 --workers N` "
                "or train with all-reduce (strategy 'multi_worker_mirrored')"
            )
        if self.server.job_name == "ps":
            raise StrategyError(
                f"{self.server.name} is a ps task: it serves variables and trains nothing, so it builds no strategy. "
                "Start ps tasks with `towerflow launch` (it runs them as `python -m towerflow.ps.serve`), or run "
                "`python -m towerflow.ps.serve` with the task's flags, or in the script call "
                "`towerflow.Server(...).join()` when the job is 'ps' (as the seeds do)"
            )
        replicas = [(t.job, t.task) for t in cluster.replicas()]
        here = (self.server.job_name, self.server.task_index)
        if here not in replicas:
            raise StrategyError(f"{self.server.name} is neither chief nor worker; only those train with parameter servers")
        # The task's settings (towerflow launch --mode ...); arguments win over the environment.
        task = self.server.context
        if dense_place(dense, task) != self.dense:
            raise StrategyError(f"dense={dense_place(dense, task)!r} with {type(self).__name__}, which trains the dense "
                                f"parameters {self.dense!r}: build ParameterServerStrategy(dense=...) instead")
        device = task.identity.device if device is None else device
        mode = mode or task.ps.mode or "async"
        replicas_to_aggregate = task.ps.replicas_to_aggregate if replicas_to_aggregate is None else replicas_to_aggregate
        staleness = task.ps.staleness if staleness is None else staleness
        local_steps = check_local_steps(task.ps.local_steps if local_steps is None else local_steps)
        ps_replicas = check_ps_replicas((task.ps.replicas or 1) if ps_replicas is None else ps_replicas,
                                        cluster.num_tasks("ps"))
        ps_replica_lag = check_replica_lag((task.ps.replica_lag or 0) if ps_replica_lag is None else ps_replica_lag,
                                           ps_replicas, mode)
        self._restarted_at = task.identity.restarted_at
        if partition_strategy not in PARTITION_STRATEGIES:
            raise ParameterServerError(f"partition_strategy={partition_strategy!r}: expected one of {PARTITION_STRATEGIES} "
                                       "(TF's embedding_lookup: 'mod' puts id i on ps task i % P, 'div' splits ranges)")

        torch_device, device_name = resolve_device(device) if device is not None else default_device()
        if torch_device.type == "cuda":
            torch.cuda.set_device(torch_device)
        elif not task.tuning.threads_set_by_user:
            torch.set_num_threads(cluster.threads_per_local_task(os.cpu_count() or 1))
        spec = PolicySpec(mode, len(replicas), replicas_to_aggregate, staleness, staleness_aware_lr)
        # built here only so that a bad mode or setting fails on the worker, with the policy's own message
        described = make_policy(spec).describe()
        if prefetch and mode == "sync":
            raise ParameterServerError(
                "prefetch=True with mode='sync': a sync worker must wait for the aggregated update before it pulls; "
                "drop prefetch or use mode='async' / 'ssp'"
            )
        if prefetch and local_steps > 1:
            raise ParameterServerError(
                f"prefetch=True with local_steps={local_steps}: a local-steps worker installs the ps's values right "
                "after it pushes its delta, which prefetch would delay by a round (its own delta missing); drop prefetch "
                "(with local steps a worker talks to the ps once every k steps anyway)"
            )
        super().__init__(torch_device, device_name, num_replicas=len(replicas), replica_id=replicas.index(here),
                         context=task)
        self.client = PSClient(self.server, model_name, replicas.index(here), here == replicas[0], torch_device,
                               spec, prefetch, on_global_step=self._on_ps_global_step, ps_replicas=ps_replicas,
                               replica_lag=ps_replica_lag)
        self.ps_replicas = ps_replicas  # 2: each ps task's part mirrored on the next
        self.ps_replica_lag = ps_replica_lag  # > 0: replication runs behind, bounded
        self.recovery = Recovery(self.client)
        self.mode = mode
        self._described = described
        self.prefetch = prefetch
        self.local_steps = local_steps
        self.placement = placement
        self.partition = partition
        self.model_name = model_name
        self.partition_strategy = partition_strategy
        self.num_ps = cluster.num_tasks("ps")
        self.lookups: Optional[TableLookups] = None

    @property
    def table_device(self) -> str:
        """Where to build embedding tables (`nn.EmbeddingBag(..., device=strategy.table_device)`): 'meta',
        since their rows live on the ps tasks and a worker never needs to allocate them."""
        return "meta"

    # ---- what the client knows, as the strategy's attributes
    @property
    def layout(self) -> Optional[Layout]:
        return self.client.layout

    @property
    def policy(self) -> PolicySpec:
        """How the ps tasks combine pushes (they build the policy from this description)."""
        return self.client.policy

    @property
    def recoveries(self) -> List[dict]:
        """One entry per lost ps this worker went on after."""
        return self.recovery.recoveries

    @property
    def is_finished(self) -> bool:
        """Whether this worker has said it is done (`finish`), or was restarted after it had: it pushes
        no more. MonitoredTrainingSession.should_stop() is true then; a loop of its own should test it."""
        return self.client.finished

    # ---- model and optimizer
    def setup(self, model, optimizer=None, lr_schedule: Optional[Callable[[int], float]] = None,
              clip_grad_norm: Optional[float] = None, sparse_optimizer: Optional[RowOptimizer] = None,
              table_init_std: Optional[float] = None, seed: int = 0):
        """Place the variables on the ps tasks (the chief sends their values), pull them, wrap the optimizer.

        Embedding tables (`nn.Embedding` / `nn.EmbeddingBag` with sparse=True or built on the meta device,
        `HashEmbedding`, or above `partition` bytes) stay on the ps tasks, row-sharded by
        `partition_strategy`, and are trained there by `sparse_optimizer` (default: the row-wise version
        of `optimizer`); tables built on the meta device are drawn there from N(0, std), std the
        table module's `init_std` attribute when set, else `table_init_std`, else PyTorch's 1, from
        `seed`. clip_grad_norm clips the dense gradients only. With `local_steps` > 1 the optimizer steps on
        this worker (lr_schedule and clip_grad_norm apply to its steps) and tables are refused.
        """
        if optimizer is None:
            raise StrategyError("ParameterServerStrategy.setup needs the optimizer: the ps tasks run it")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise StrategyError(f"clip_grad_norm={clip_grad_norm!r}: expected a positive number or None")
        tables = find_tables(model, self.partition)
        if tables and self.local_steps > 1:
            raise ParameterServerError(
                f"local_steps={self.local_steps} with embedding tables {sorted(tables)}: their rows are trained on the ps "
                "from row gradients, which a local-steps worker does not push; use local_steps=1 (drop --local-steps) "
                "for models with tables"
            )
        specs = [table_spec(name, m, self.num_ps, self.partition_strategy, table_init_std, seed)
                 for name, m in tables.items()]
        table_weights = {id(m.weight) for m in tables.values() if isinstance(getattr(m, "weight", None), torch.nn.Parameter)}
        values = {name: detach_rows(m) for name, m in tables.items()}
        values = {name: v for name, v in values.items() if v is not None} if self.client.is_chief else {}
        model = model.to(self.device)
        params = dict(model.named_parameters())
        meta = [name for name, p in params.items() if p.is_meta]
        if meta:
            raise ParameterServerError(f"parameters {meta[:5]} are on the meta device; only embedding tables may be "
                                       "(their rows live on the ps): build the rest of the model on a real device")
        on_ps = self._dense_on_ps(optimizer, params, table_weights)
        row_optimizer = None
        if specs:
            row_optimizer = sparse_optimizer if sparse_optimizer is not None else row_optimizer_for(optimizer)
        settings = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        self.client.attach(plan_layout(on_ps, self.num_ps, self.placement, self.partition),
                           on_ps, type(optimizer), settings, specs, values, row_optimizer,
                           replan=lambda n: plan_layout(on_ps, n, self.placement, self.partition))
        del values
        if tables:
            self.lookups = TableLookups(model, tables, lambda ids: self.recovery.guarded(lambda: self.client.read_rows(ids)),
                                        self.device)
        model = self._replicate_dense(model)
        if self.recovery.connect() is not None:
            self.recovery.say_rejoined(self._restarted_at)
        return model, self._wrap_optimizer(model, optimizer, list(on_ps.values()), lr_schedule, clip_grad_norm)

    def _dense_on_ps(self, optimizer, params: Dict[str, torch.nn.Parameter], table_weights) -> Dict[str, torch.nn.Parameter]:
        """The parameters the ps tasks hold and train besides the tables: all of them, under one optimizer."""
        groups = optimizer.param_groups
        ids = {id(p) for p in groups[0]["params"]} - table_weights if len(groups) == 1 else set()
        if len(groups) != 1 or ids != {id(p) for p in params.values()}:
            raise ParameterServerError(
                "the ps runs one optimizer over all the model's parameters: build it as "
                "Optimizer(model.parameters(), ...) with a single parameter group"
            )
        if params:
            check_optimizer(type(optimizer))
        return params

    def _replicate_dense(self, model: torch.nn.Module) -> torch.nn.Module:
        """What the workers do with the dense part before they join the ps tasks: nothing, it lives there."""
        return model

    def _wrap_optimizer(self, model, optimizer, on_ps, lr_schedule, clip_grad_norm):
        return PSOptimizer(optimizer, self.client, self.recovery, on_ps, lr_schedule, clip_grad_norm, self.lookups,
                           self.local_steps)

    def _on_ps_global_step(self, step: int) -> None:
        """The ps tasks' global step, heard with every set of values installed: this worker's global step."""
        self.steps.restore(step)

    def restore_ps_from(self, source: Callable[[], Any]) -> bool:
        """Where the chief finds the ps tasks' state when a ps is lost: `source()` returns
        (step, path, state) of the newest checkpoint, state as `optimizer.state_dict()` saved it,
        or None. MonitoredTrainingSession with a logdir sets this. A restarted chief that found ps tasks lost
        together with it and no mirror of theirs restores every ps task from it now (returns True)."""
        self.recovery.restore_source = source
        return self.recovery.finish_pending_restore()

    def _batch_weight(self, batch) -> float:
        return 1.0  # each worker's gradient is its own batch's mean: the ps averages (sync) or applies it as is

    # ---- measurement
    def metrics(self) -> dict:
        """This worker's view: the mode, steps/s, bytes pushed and pulled per ps task, staleness of its pushes."""
        return {"mode": self._described, **self.client.metrics()}

    def ps_metrics(self) -> Dict[str, dict]:
        """Each ps task's counters (global step, updates, dropped stale gradients, staleness, bytes per worker)."""
        return self.recovery.guarded(lambda: inspection.ps_metrics(self.client.calls))

    def variables(self) -> Dict[str, torch.Tensor]:
        """The current values on the ps tasks, reassembled per variable (for checks and checkpoints)."""
        return self.recovery.guarded(lambda: inspection.values(self.client.calls, self.client.model))

    def table_values(self) -> Dict[str, torch.Tensor]:
        """Every fixed embedding table, put together from the ps tasks (brings whole tables here: for checks
        and small exports)."""
        return self.recovery.guarded(lambda: inspection.table_values(self.client.calls, self.client.model))

    # ---- collectives: none between workers; each worker reports its own view
    def reduce(self, value: Any, op: str = "mean") -> torch.Tensor:
        """This worker's value: ps workers share no process group (evaluate on the chief)."""
        return super().reduce(value, op)

    def finish(self) -> None:
        """Say this worker is done (slower peers stop waiting for it); waits for its pushes first."""
        if not self.client.begin_finish():
            return
        self.recovery.guarded(self.client.finish)
        self.client.announce_finished()  # a restored ps learns it

    def wait_for_workers(self, refresh: bool = True) -> int:
        """finish(), wait until every worker has finished, and (`refresh`) pull the final values into
        the model, for the chief's evaluation and checkpoint; returns the final global step."""
        self.finish()
        step = self.recovery.guarded(self.client.wait_finished)
        if refresh and self.client.channels:
            self.recovery.guarded(lambda: self.client.install(self.client.pull()))
        self.steps.restore(step)
        return step

    def _files_resume(self) -> Resume:
        """Where this worker's files stand: its clock, the pushes the ps tasks counted from it (k batches a push
        with local steps), and, for a job restored onto another number of workers, the old workers' clocks. A
        restarted worker learned its clock when it rejoined; a fresh one asks, since the job may have been
        restored from a checkpoint, which keeps the clocks."""
        return resume_point(self.client.clock_at_ps(), self.client.pushes, self.local_steps)

    def files_checkpoint(self) -> dict:
        """Nothing: the ps tasks' own checkpoints keep every worker's clock (and an earlier job's workers')."""
        return {}

    def restore_files_checkpoint(self, state: Any, step: int) -> None:
        """Nothing: a restored ps tells each worker where it stands (`_files_resume`)."""

    def shutdown(self) -> None:
        """finish(), then, when this strategy started the task's server, wait for the others and leave."""
        self.finish()
        if self._owns_server:
            self.server.join()

    def __repr__(self) -> str:
        geo = f", {self.local_steps} local steps per push" if self.local_steps > 1 else ""
        return (f"ParameterServerStrategy(worker {self.replica_id} of {self.num_replicas_in_sync}, {self.num_ps} ps, "
                f"{self._described}{geo}, on {self.device_name})")
