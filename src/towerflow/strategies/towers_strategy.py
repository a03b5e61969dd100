"""Towers in one process as a strategy: several CPU devices trained by threads of this one process.

TF's MirroredStrategy over logical CPUs. The towers share one copy of the parameters and sum their
gradients in memory (`towers.py`), so there is no process group: what the all-reduce strategy does
with DDP, this one does with `TowerModule`. `MirroredStrategy(...)` gives one when the rule in
`towers.towers_mode` says threads, so a script written for Mirrored runs unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from towerflow import taskenv as _taskenv
from towerflow.errors import StrategyError
from towerflow.strategies import _host_memory
from towerflow.strategies import towers as _towers
from towerflow.strategies.mirrored import MirroredStrategy
from towerflow.strategies.tower_pool import TowerPool, default_threads_per_tower
from towerflow.strategies.base import task_context


class TowersStrategy(MirroredStrategy):
    """One tower per CPU device in this process (`MirroredStrategy(towers="threads")`, or the default rule).

    A MirroredStrategy (`isinstance` holds, `name` is "mirrored"): `num_replicas_in_sync` is the number of
    towers, `distribute_loader(batch_size=)` is per tower, the loader shards by process (one shard here),
    and `reduce` returns this process's value. `threads_per_tower`: torch threads of each tower (default:
    the host's cores split among the towers, also the count of this thread, which runs tower 0 and the
    optimizer step; OMP_NUM_THREADS set leaves them alone). The all-reduce options (`backend`,
    `timeout_s`, `bucket_cap_mb`, `find_unused_parameters`) are taken and unused: there is no process group.
    """

    towers = "threads"

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
        if towers == "processes":
            raise StrategyError("TowersStrategy(towers='processes'): use MirroredStrategy(towers='processes')")
        context = task_context(context)
        env = self._read_env(context)
        _towers.towers_mode("threads", env, devices)  # refuses a launcher's replica process
        self.tower_devices = _towers.tower_devices(devices)
        n = len(self.tower_devices)
        # MirroredStrategy's own __init__ builds a replica process: skip it, keep what comes after it
        super(MirroredStrategy, self).__init__(torch.device("cpu"), self.tower_devices[0], n, 0, variables_on,
                                               mixed_precision, context)
        self.towers_per_process = n
        self.env = env
        self.backend = None
        self._tower_pool: Optional[TowerPool] = None
        self.host_memory: Optional[str] = None  # what _host_memory did to malloc (None: nothing)
        if threads_per_tower is None and not env.threads_set_by_user:
            threads_per_tower = default_threads_per_tower(n)
        if threads_per_tower is not None:
            torch.set_num_threads(threads_per_tower)  # this thread runs tower 0 (and the optimizer step)
        self._threads_per_tower = threads_per_tower

    def __repr__(self) -> str:
        return (f"MirroredStrategy({len(self.tower_devices)} towers in one process on "
                f"{', '.join(self.tower_devices)}, variables_on={self.variables_on!r})")

    def _update_threads(self) -> contextlib.AbstractContextManager:
        if self._tower_pool is None:
            return super()._update_threads()
        return self._tower_pool.all_threads()  # the towers wait for the next forward: the update gets their cores

    def _wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self._tower_pool is None:
            if self.env.towers_allocator == "keep":
                self.host_memory = _host_memory.keep_freed_memory()
            self._tower_pool = TowerPool(len(self.tower_devices), self._threads_per_tower)
        return _towers.TowerModule(model, self._tower_pool)

    def shutdown(self) -> None:
        if self._tower_pool is not None:
            self._tower_pool.close()
            self._tower_pool = None
