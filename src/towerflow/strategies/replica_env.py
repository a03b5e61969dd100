"""This process's place in the replica process group, from the task environment (`towerflow.taskenv`).

Kept apart from `environment.py` (which picks a strategy and so imports them all) so that a
strategy can read its place without importing the module that chooses among strategies.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from towerflow import taskenv as _taskenv


@dataclasses.dataclass(frozen=True)
class ReplicaEnv:
    """This process's place in the replica process group, from torchrun's variables and TF_CONFIG."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    assigned_device: Optional[str] = None
    cluster: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
    task_type: Optional[str] = None
    task_index: int = 0
    master_addr: Optional[str] = None  # where the replicas' process group meets
    master_port: Optional[int] = None
    group_prefix: Optional[str] = None  # torchrun's agent serves the group's store: meet in it under this prefix
    threads_set_by_user: bool = False  # OMP_NUM_THREADS is set: leave torch's thread count alone
    towers_allocator: str = "keep"  # TOWERFLOW_TOWERS_ALLOCATOR (strategies/_host_memory.py)
    join_timeout: float = _taskenv.DEFAULT_JOIN_TIMEOUT
    heartbeat_timeout: float = _taskenv.DEFAULT_HEARTBEAT_TIMEOUT

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_multi_host(self) -> bool:
        hosts = {a.rsplit(":", 1)[0] for job, addrs in self.cluster.items() if job != "ps" for a in addrs}
        return len(hosts) > 1 or self.world_size > self.local_world_size

    @property
    def has_ps(self) -> bool:
        return bool(self.cluster.get("ps"))


def read_env(task: _taskenv.TaskContext) -> ReplicaEnv:
    """This task's place in the replica group, from its context."""
    cluster = {k: list(v) for k, v in task.identity.cluster.items()}
    world = task.identity.world_size or 1
    rank = task.identity.rank or 0
    local_world = task.identity.local_world_size or 0
    if not local_world:  # not in the contract; derive it: same-host peers in TF_CONFIG, else one host
        replicas = [a for job in ("chief", "worker") for a in cluster.get(job, [])]
        here = replicas[rank].rsplit(":", 1)[0] if rank < len(replicas) and len(replicas) == world else None
        local_world = sum(a.rsplit(":", 1)[0] == here for a in replicas) if here else world
    return ReplicaEnv(
        rank=rank,
        world_size=world,
        local_rank=task.identity.local_rank if task.identity.local_rank is not None else (rank if local_world == world else 0),
        local_world_size=local_world,
        assigned_device=task.identity.device,
        cluster=cluster,
        task_type=task.identity.job_name if cluster else None,
        task_index=task.identity.task_index or 0,
        master_addr=task.identity.master_addr,
        master_port=task.identity.master_port,
        group_prefix=task.agent_store_prefix,
        threads_set_by_user=task.tuning.threads_set_by_user,
        towers_allocator=task.tuning.towers_allocator,
        join_timeout=task.join.join_timeout,
        heartbeat_timeout=task.join.heartbeat_timeout,
    )
