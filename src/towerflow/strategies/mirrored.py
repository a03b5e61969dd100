"""Synchronous data parallelism with all-reduce: one replica process per local device.

TF's `MirroredStrategy` built as torch does it best: one process per device (so no GIL
contention between towers), `DistributedDataParallel` for the gradients (bucketed all-reduce
overlapping the backward pass), NCCL between GPUs, gloo on CPUs. Replicas are started by
`towerflow launch` (or torchrun) and find each other through torchrun's variables.

With `towers="threads"` (the default for several CPU devices in one process with no launcher),
`MirroredStrategy(...)` is a `TowersStrategy` instead: the devices are towers of this one process,
averaging in memory (`towers_strategy.py`).

With `variables_on="cpu"` (the variables on the host, as in TF's multi-GPU towers) there is no DDP: gradients come down to the
host CPU, are averaged there with one all-reduce over a gloo group, the optimizer runs on
the CPU copies, and the new values go back to the device.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import inspect
import os
import warnings
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from towerflow import taskenv as _taskenv
from towerflow.cluster import exit_hooks as _exit_hooks
from towerflow.cluster.membership import replica_rendezvous
from towerflow.errors import StrategyError
from towerflow.strategies import towers as _towers
from towerflow.strategies._devices import confine_replica_memory, replica_device
from towerflow.strategies._local_tables import LocalTablesStrategy
from towerflow.strategies.base import task_context
from towerflow.strategies.replica_env import ReplicaEnv, read_env

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class MirroredStrategy(LocalTablesStrategy):
    """One replica per local device (GPUs, or logical CPU devices), all-reduce between them.

    `towers`: "processes" (one replica process per device, started by `towerflow launch`),
    "threads" (the CPU devices as towers of this one process), or None: threads when this process
    is not one of a launcher's replicas and has several CPU devices (`devices`, else the logical
    CPU devices), else processes. With threads, `MirroredStrategy(...)` returns a `TowersStrategy`
    (a MirroredStrategy still, so a script need not know which layout it got); `threads_per_tower`
    is its torch threads per tower. Subclasses (MultiWorkerMirroredStrategy) are one process per replica.
    """

    name = "mirrored"
    towers = "processes"  # the layout: one replica per process ("threads": TowersStrategy)

    def __new__(cls, *args: Any, **kwargs: Any) -> "MirroredStrategy":
        if cls is MirroredStrategy:
            options = inspect.signature(cls.__init__).bind(None, *args, **kwargs).arguments
            context = options.get("context") or _taskenv.from_environment()
            if _towers.towers_mode(options.get("towers"), read_env(context), options.get("devices")) == "threads":
                from towerflow.strategies.towers_strategy import TowersStrategy  # a subclass: imported on use

                return super().__new__(TowersStrategy)
        return super().__new__(cls)

    def __init__(
        self,
        devices: Optional[Sequence[str]] = None,
        variables_on: str = "device",
        mixed_precision: Optional[str] = None,
        backend: Optional[str] = None,
        timeout_s: float = 300.0,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        towers: Optional[str] = None,
        threads_per_tower: Optional[int] = None,
        context: Optional[_taskenv.TaskContext] = None,
    ):
        context = task_context(context)
        env = self._read_env(context)
        _towers.towers_mode(towers, env, devices)  # checks the value (and threads under a launcher)
        if towers == "threads":  # not MirroredStrategy itself (its __new__ made a TowersStrategy): a subclass
            raise StrategyError(
                f"towers='threads' with {type(self).__name__}: it trains one replica per process. Towers in one "
                "process are MirroredStrategy(towers='threads')"
            )
        device, device_name = self._pick_device(env, devices)
        super().__init__(device, device_name, env.world_size, env.rank, variables_on, mixed_precision, context)
        self.env = env
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.memory_cap: Optional[int] = None  # bytes: a replica on one logical device of a split GPU
        if device.type == "cuda":
            torch.cuda.set_device(device)
            if env.local_world_size > 1:
                self.memory_cap = confine_replica_memory(device_name)
        elif env.local_world_size > 1 and not env.threads_set_by_user:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))  # no oversubscription
        self.backend = backend or self._pick_backend(device, env)
        self._owns_group = False
        self._host_group = None
        self._wrapped: list = []  # weak references to the DDP modules made here: shutdown takes the group from them
        self._heartbeat: Optional[replica_rendezvous.Heartbeat] = None
        if env.is_distributed:
            _exit_hooks.install()  # also for a failure to meet the other replicas
            self._init_group(timeout_s)
            # an uncaught error is recorded (its traceback, or as the consequence of a lost peer) and the
            # replica exits at once: that closes its connections, so its peers fail within seconds rather
            # than at the collective's timeout, and the launcher names the replica that failed first
            _exit_hooks.install(exit_at_once=True)
        elif devices is None and device.type == "cuda" and torch.cuda.device_count() > 1:
            warnings.warn(
                f"{type(self).__name__} in a single process trains on {device_name} only, not on all "
                f"{torch.cuda.device_count()} GPUs: start one process per device with "
                f"`towerflow launch --nproc {torch.cuda.device_count()} script.py` (or torchrun)",
                stacklevel=2,
            )

    # ---- construction
    def _read_env(self, context: "_taskenv.TaskContext") -> ReplicaEnv:
        return read_env(context)

    def _pick_device(self, env: ReplicaEnv, devices: Optional[Sequence[str]]):
        return replica_device(env.local_rank, env.local_world_size, devices, env.assigned_device)

    @staticmethod
    def _pick_backend(device: torch.device, env: ReplicaEnv) -> str:
        # NCCL refuses two ranks on one GPU (logical GPU devices of one physical GPU): gloo then.
        if device.type == "cuda" and env.local_world_size <= torch.cuda.device_count():
            return "nccl"
        return "gloo"

    def _init_group(self, timeout_s: float) -> None:
        if dist.is_initialized():
            if dist.get_world_size() != self.num_replicas_in_sync:
                raise StrategyError(
                    f"a process group of {dist.get_world_size()} ranks already exists but WORLD_SIZE="
                    f"{self.num_replicas_in_sync}: destroy it first or launch with a matching WORLD_SIZE"
                )
            return
        missing = [v for v, value in (("MASTER_ADDR", self.env.master_addr), ("MASTER_PORT", self.env.master_port))
                   if not value]
        if missing:
            raise StrategyError(
                f"WORLD_SIZE={self.num_replicas_in_sync} but {', '.join(missing)} is not set: start replicas with "
                "`towerflow launch` or torchrun, which set the rendezvous address"
            )
        kwargs = {}
        if self.backend == "nccl":
            kwargs["device_id"] = self.device
        if self.variables_on != "cpu":
            # DDP imports torch._dynamo; imported only once the group exists, it keeps the group alive past
            # destroy_process_group (measured: gloo's threads then run on through the interpreter's exit, where
            # replicas have rarely aborted, "terminate called without an active exception"). Imported first, the
            # group and its threads go with the DDP module.
            import torch._dynamo  # noqa: F401
        names = replica_rendezvous.replica_names(self.env.cluster, self.num_replicas_in_sync)
        addr, port = self.env.master_addr, self.env.master_port
        prefix = self.env.group_prefix
        store = replica_rendezvous.join(addr, port, self.replica_id, names, self.env.join_timeout, prefix=prefix)
        self._heartbeat = replica_rendezvous.Heartbeat(addr, port, self.replica_id, names, self.env.heartbeat_timeout,
                                                       store=store, prefix=prefix).start()
        atexit.register(self._heartbeat.finish)
        dist.init_process_group(
            self.backend,
            store=store,
            rank=self.replica_id,
            world_size=self.num_replicas_in_sync,
            timeout=datetime.timedelta(seconds=timeout_s),
            **kwargs,
        )
        self._owns_group = True

    # ---- model
    def _wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.env.is_distributed:
            return model
        if self.variables_on == "cpu":
            self._broadcast_state(model)  # no DDP to do it: start every replica from rank 0's values
            return model
        wrapped = DistributedDataParallel(
            model,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=True,
        )
        self._wrapped.append(weakref.ref(wrapped))
        return wrapped

    def _group_for_host(self):
        if self.backend == "gloo":
            return None  # the default group already works on CPU tensors
        if self._host_group is None:
            self._host_group = dist.new_group(backend="gloo")
        return self._host_group

    @torch.no_grad()
    def _broadcast_state(self, model: torch.nn.Module) -> None:
        group = self._group_for_host()
        for t in model.state_dict().values():
            host = t.detach().to("cpu", copy=True)
            dist.broadcast(host, src=0, group=group)
            t.copy_(host)

    def _average_on_host(self, flat_grads: torch.Tensor) -> None:
        if self.env.is_distributed:
            dist.all_reduce(flat_grads, group=self._group_for_host())
            flat_grads.div_(self.num_replicas_in_sync)

    # ---- collectives
    def reduce(self, value: Any, op: str = "mean") -> torch.Tensor:
        out = super().reduce(value, op)
        if not self.env.is_distributed:
            return out
        comm_device = self.device if self.backend == "nccl" else torch.device("cpu")
        t = out.to(comm_device)
        dist.all_reduce(t, op=_REDUCE_OPS[op])
        if op == "mean":
            t /= self.num_replicas_in_sync
        return t.cpu()

    def barrier(self) -> None:
        if self.env.is_distributed:
            dist.barrier(**({"device_ids": [self.device.index]} if self.backend == "nccl" else {}))

    def _release_wrapped(self) -> None:
        """Take the process group from the DDP modules still alive. Each one's reducer holds the group, so the
        group (and gloo's threads) would otherwise live until the module is collected, often while the
        interpreter finalizes, where a C++ thread touching a Python object aborts or hangs the process at exit
        (pytorch/pytorch#190489). A module so released trains no more: it is shut down with the strategy."""
        for ref in self._wrapped:
            module = ref()
            if module is not None:
                for name in ("logger", "reducer", "process_group"):
                    if hasattr(module, name):
                        setattr(module, name, None)
        self._wrapped = []
        gc.collect()

    def shutdown(self) -> None:
        """Leave the replicas' group, every replica at once; a model it wrapped trains no more afterwards (use
        `strategy.unwrap(model)` to evaluate or save it then)."""
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.finish()
            atexit.unregister(heartbeat.finish)
        if self._owns_group and dist.is_initialized():
            # Every replica reaches here before any tears down: a replica destroying its group
            # (and rank 0 taking the rendezvous store with it) while a peer is still mid-collective
            # makes gloo abort that peer ("terminate called without an active exception").
            self.barrier()
            dist.destroy_process_group()
            self._release_wrapped()
        self._owns_group = False
        if heartbeat is not None:
            heartbeat.release()
