"""Hybrid training: embedding tables on the ps tasks, the dense layers replicated and all-reduced.

A recommendation model is two models in one: tables too big for a worker, touched a few rows a step,
and dense layers every sample touches in full. `ParameterServerStrategy(dense="allreduce")` (or
`towerflow launch --ps N --workers M --dense allreduce`) keeps them apart, as PERSIA and TorchRec do:

* the tables (`nn.EmbeddingBag(sparse=True)`, `HashEmbedding`) live on the ps tasks exactly as under
  `ParameterServerStrategy`, trained there in its mode (async, sync with backups, ssp) from the rows a
  step touched (`ps/worker/lookups.py`);
* every other parameter lives on each worker, wrapped in DDP over the workers' process group (the one
  `MultiWorkerMirroredStrategy` forms: gloo on CPUs, NCCL on GPUs), its gradients all-reduced while the
  backward pass runs, and the user's optimizer steps it on each worker (`_hybrid_optimizer.py`).

It is a `ParameterServerStrategy` (the constructor returns this class for `dense="allreduce"`), so a
script that tests `strategy.shared_variables` or calls `wait_for_workers` runs unchanged. The chief
alone restores a checkpoint (dense part and tables); at the first forward every worker takes the
chief's dense values, optimizer state and global step from it, so a restore onto any number of workers
starts them all alike.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from towerflow.errors import StrategyError
from towerflow.strategies._hybrid_optimizer import HybridOptimizer
from towerflow.strategies.base import Strategy
from towerflow.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from towerflow.strategies.parameter_server import ParameterServerStrategy


class _DenseReplicas(MultiWorkerMirroredStrategy):
    """The workers' all-reduce group for the dense part, on the device the ps side already chose."""

    def __init__(self, device: torch.device, device_name: str, **options: Any):
        self._chosen = (device, device_name)
        super().__init__(**options)

    def _pick_device(self, env, devices):
        return self._chosen


class HybridStrategy(ParameterServerStrategy):
    """Tables on the ps tasks in the mode asked; the rest replicated on the workers and all-reduced (DDP)."""

    name = "hybrid"
    dense = "allreduce"

    def __init__(self, *args: Any, backend: Optional[str] = None, timeout_s: float = 300.0,
                 bucket_cap_mb: float = 25.0, **options: Any):
        if options.get("prefetch"):
            raise StrategyError("prefetch=True with dense='allreduce': there are no dense values to pull ahead (the "
                                "dense part is on the workers, and table rows are read by each forward); drop prefetch")
        super().__init__(*args, **options)
        if self.local_steps > 1:
            raise StrategyError(
                f"local_steps={self.local_steps} with dense='allreduce': the dense part is all-reduced every step and "
                "the tables learn from each step's row gradients, so there is no delta to push every k steps; drop "
                "--local-steps, or train with dense='ps'")
        threads = torch.get_num_threads()
        self.replicas = _DenseReplicas(self.device, self.device_name, backend=backend, timeout_s=timeout_s,
                                       bucket_cap_mb=bucket_cap_mb, context=self.context)
        torch.set_num_threads(threads)  # the ps side's share of the host's cores (ps tasks counted), kept
        group = (self.replicas.num_replicas_in_sync, self.replicas.replica_id)
        if group != (self.num_replicas_in_sync, self.replica_id):
            raise StrategyError(
                f"{self.server.name} is worker {self.replica_id} of {self.num_replicas_in_sync} in the cluster, but rank "
                f"{group[1]} of a replica group of {group[0]} (RANK / WORLD_SIZE): the dense part is all-reduced among "
                "the chief and the workers, in that order. Start the tasks with `towerflow launch --ps N --workers M "
                "--dense allreduce`, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for the chief and workers")
        self._synced = False

    # ---- model and optimizer (ParameterServerStrategy.setup calls these)
    def _dense_on_ps(self, optimizer, params, table_weights) -> Dict[str, torch.nn.Parameter]:
        """Nothing but the tables goes to the ps tasks; the user's optimizer steps the dense part here."""
        return {}

    def _replicate_dense(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP over the workers' group (before joining the ps tasks: the chief opens them only at its first
        forward, and DDP's first broadcast needs every worker)."""
        wrapped = self.replicas._wrap_model(model)
        self._module = model
        handle = wrapped.register_forward_pre_hook(lambda *_: self._sync_from_chief(handle))
        return wrapped

    def _wrap_optimizer(self, model, optimizer, on_ps, lr_schedule, clip_grad_norm):
        self._optimizer = HybridOptimizer(optimizer, self, lr_schedule=lr_schedule, clip_grad_norm=clip_grad_norm)
        return self._optimizer

    def _sync_from_chief(self, handle) -> None:
        """First forward: the chief lets the others past the ps's door, then every worker takes the chief's dense
        values, dense optimizer state and global step (what a checkpoint restored on the chief alone)."""
        handle.remove()
        if self._synced:
            return
        self._synced = True
        if self.client.is_chief:
            self.client.open()
        if not self.replicas.env.is_distributed:
            return
        self.replicas._broadcast_state(self._module)
        optimizer = self._optimizer.optimizer if self._optimizer is not None else None
        held = [self.global_step, optimizer.state_dict() if optimizer is not None and self.is_chief else None]
        dist.broadcast_object_list(held, src=0)
        if not self.is_chief:
            self.steps.restore(held[0])
            if optimizer is not None and held[1] is not None:
                optimizer.load_state_dict(held[1])

    def _on_ps_global_step(self, step: int) -> None:
        """The ps's count is its own (async: every worker's push); the global step is the all-reduced steps'."""

    def _batch_weight(self, batch) -> float:
        return Strategy._batch_weight(self, batch)  # the all-reduce's weighting; sync tables average it alike

    # ---- the tables' side of a step, and of a checkpoint (HybridOptimizer calls these)
    def _push_rows(self) -> None:
        rows = self.lookups.take_row_grads() if self.lookups is not None else None
        if self.client.channels and not self.client.finished:
            self.recovery.guarded(lambda: self.client.push_pull(None, rows), retry=False)

    def _ps_state(self) -> Dict[int, dict]:
        return self.recovery.guarded(self.client.state) if self.client.channels else {}

    def _load_ps_state(self, parts: Dict[Any, dict]) -> None:
        """Put a checkpoint's tables on the ps tasks, unless this chief is a restarted one: the ps tasks then
        kept training while it was down (a lost worker never touches the tables), and their state is newer."""
        if parts and self.server.incarnation == 0:
            self.recovery.guarded(lambda: self.client.load_state(parts))

    # ---- collectives: the workers' group
    def reduce(self, value: Any, op: str = "mean") -> torch.Tensor:
        """`value` combined over the workers (they share a process group here)."""
        return self.replicas.reduce(value, op)

    def barrier(self) -> None:
        self.replicas.barrier()

    def wait_for_workers(self, refresh: bool = True) -> int:
        """finish(), then wait until every worker has finished with the ps tasks; returns the global step."""
        self.finish()
        self.recovery.guarded(self.client.wait_finished)
        return self.global_step

    def metrics(self) -> dict:
        return {**super().metrics(), "dense": f"all-reduced over {self.num_replicas_in_sync} workers "
                                              f"({self.replicas.backend})"}

    def shutdown(self) -> None:
        """finish() with the ps tasks, leave the workers' group (every worker at once), then the cluster."""
        self.finish()
        self.replicas.shutdown()
        if self._owns_server:
            self.server.join()

    def __repr__(self) -> str:
        return (f"HybridStrategy(worker {self.replica_id} of {self.num_replicas_in_sync}, tables on {self.num_ps} ps "
                f"({self._described}), dense all-reduced ({self.replicas.backend}), on {self.device_name})")
