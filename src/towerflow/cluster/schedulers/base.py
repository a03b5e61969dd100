"""The interface every scheduler resolver implements, and what it returns: a frozen `Resolved`.

A resolver is pure: it reads a `Mapping[str, str]` (`TaskContext.scheduler_env`, or a recorded
environment in a test), never the process's environment, and starts nothing.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

from towerflow import taskenv as _te
from towerflow.cluster.spec import ClusterSpec, split_address
from towerflow.errors import SchedulerError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Roles:
    """How a scheduler's ranks split into jobs: `ps` ps tasks, a chief, an evaluator; the rest are workers.

    As TensorFlow's SlurmClusterResolver: jobs in sorted name order take consecutive ranks
    (chief, evaluator, ps, worker), so with ps=1 of 4 ranks rank 0 is ps:0 and ranks 1-3 are worker:0-2.
    """

    ps: int = 0
    chief: bool = False
    evaluator: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Roles":
        """TOWERFLOW_PS_TASKS, TOWERFLOW_CHIEF, TOWERFLOW_EVALUATOR (unset: no ps, no chief, no evaluator)."""
        ps = count(env, _te.ENV_PS_TASKS, "the number of ranks that are ps tasks")
        return cls(ps or 0, _flag(env, _te.ENV_CHIEF), _flag(env, _te.ENV_EVALUATOR))

    @property
    def is_default(self) -> bool:
        return self == Roles()

    def split(self, world_size: int) -> Dict[str, int]:
        """Job -> number of tasks, in the order the jobs take ranks."""
        fixed = {"chief": int(self.chief), "evaluator": int(self.evaluator), "ps": self.ps}
        workers = world_size - sum(fixed.values())
        if self.ps < 0 or workers < 0 or (workers == 0 and not self.chief):
            raise SchedulerError(
                f"roles ps={self.ps}, chief={self.chief}, evaluator={self.evaluator} need {sum(fixed.values()) + 1} "
                f"ranks or more (at least one chief or worker), but the scheduler started {world_size}; start more "
                f"tasks or ask for fewer ps tasks ({_te.ENV_PS_TASKS} / --ps)"
            )
        return {job: n for job, n in sorted({**fixed, "worker": workers}.items()) if n}

    def place(self, rank: int, world_size: int) -> Tuple[str, int]:
        """(job, index) of a rank."""
        start = 0
        for job, n in self.split(world_size).items():
            if rank < start + n:
                return job, rank - start
            start += n
        raise SchedulerError(f"rank {rank} is not below the world size {world_size}")


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What a scheduler says about this process and its cluster (TF_CONFIG's shape, plus the rest)."""

    scheduler: str  # the resolver's name
    job_name: str  # this task's job ...
    task_index: int  # ... and index
    jobs: Mapping[str, int]  # job -> number of tasks (always known)
    cluster: Optional[Mapping[str, Any]]  # ClusterSpec-compatible {job: [host:port, ...]}; None: gathered at runtime
    source: Mapping[str, str]  # the variables it came from
    rank: Optional[int] = None  # the scheduler's rank of this process
    world_size: Optional[int] = None
    local_rank: Optional[int] = None  # among the tasks on this host
    local_world_size: Optional[int] = None
    device: Optional[str] = None  # the local device this task should use: "gpu:<local rank>", or None
    port: Optional[int] = None  # the port this task listens on
    rendezvous: Optional[str] = None  # host:port where the tasks gather their addresses when `cluster` is None
    restart_count: int = 0

    @property
    def address(self) -> Optional[str]:
        """This task's host:port, where the cluster is known and holds this task (TFJob's evaluator is not in it)."""
        tasks = (self.cluster or {}).get(self.job_name)
        if isinstance(tasks, Mapping):
            return tasks.get(self.task_index)
        return tasks[self.task_index] if tasks is not None and self.task_index < len(tasks) else None

    def cluster_spec(self) -> ClusterSpec:
        if self.cluster is None:
            raise SchedulerError(
                f"the {self.scheduler} environment does not say where the other tasks run; their addresses must be "
                f"gathered at runtime through the rendezvous at {self.rendezvous}"
            )
        return ClusterSpec(self.cluster)

    def as_json(self) -> Dict[str, Any]:
        """TF_CONFIG's shape ("cluster", "task") and what was detected besides."""
        cluster = None if self.cluster is None else ClusterSpec(self.cluster).as_dict()
        return {
            "scheduler": self.scheduler, "cluster": cluster, "task": {"type": self.job_name, "index": self.task_index},
            "address": self.address, "jobs": dict(self.jobs), "rank": self.rank, "world_size": self.world_size,
            "local_rank": self.local_rank, "local_world_size": self.local_world_size, "device": self.device,
            "port": self.port, "rendezvous": self.rendezvous, "restart_count": self.restart_count,
            "from": dict(self.source),
        }


class SchedulerResolver(abc.ABC):
    """One scheduler: whether its variables are there, and what they say."""

    name: ClassVar[str]
    reads: ClassVar[Tuple[str, ...]]  # the variables (or prefixes ending in '_') it reads: Resolved.source

    @abc.abstractmethod
    def detect(self, env: Mapping[str, str]) -> bool:
        """Whether `env` was set by this scheduler."""

    @abc.abstractmethod
    def resolve(self, env: Mapping[str, str], roles: Roles) -> Resolved:
        """This task and its cluster; a SchedulerError names the variable, its value and the fix."""

    def source(self, env: Mapping[str, str]) -> Dict[str, str]:
        return {k: env[k] for k in sorted(env) if k in self.reads or any(p.endswith("_") and k.startswith(p) for p in self.reads)}

    def from_ranks(self, env: Mapping[str, str], roles: Roles, ranks: "Ranks", addresses: Optional[List[str]],
                   port: Optional[int] = None, rendezvous: Optional[str] = None, restart_count: int = 0) -> Resolved:
        """A Resolved for a scheduler that gives ranks: `roles` split them into jobs, in rank order.

        With `addresses` (one per rank) this task's port is the one of its own entry, so it binds exactly
        the address the others were told; `port` is for a cluster gathered at the rendezvous.
        """
        jobs = roles.split(ranks.world_size)
        job, index = roles.place(ranks.rank, ranks.world_size)
        cluster = None
        if addresses is not None:
            cluster, start = {}, 0
            for name, n in jobs.items():
                cluster[name] = addresses[start:start + n]
                start += n
            ClusterSpec(cluster)  # duplicate or bad addresses fail here, naming the task
            port = split_address(addresses[ranks.rank])[1]
        return Resolved(
            self.name, job, index, jobs, cluster, self.source(env), ranks.rank, ranks.world_size, ranks.local_rank,
            ranks.local_world_size, gpu_hint(ranks.local_rank), port, rendezvous, restart_count,
        )


@dataclasses.dataclass(frozen=True)
class Ranks:
    """A process's place among a scheduler's ranks."""

    rank: int
    world_size: int
    local_rank: Optional[int] = None
    local_world_size: Optional[int] = None

    def __post_init__(self):
        if self.rank >= self.world_size:
            raise SchedulerError(f"rank {self.rank} with world size {self.world_size}: expected rank < world size")


def node_slot(ranks: Ranks) -> int:
    """This rank's place among its node's ports: RANK modulo LOCAL_WORLD_SIZE, not LOCAL_RANK.

    torchrun gives each node a block of consecutive ranks, so a node's ranks differ modulo its
    rank count; their LOCAL_RANK may not: under `torchrun --virtual-local-rank` every worker has
    LOCAL_RANK=0 (each sees its one GPU as device 0).
    """
    return ranks.rank % (ranks.local_world_size or 1)


def gpu_hint(local_rank: Optional[int]) -> Optional[str]:
    """The device hint of a task: the GPU of its local rank (the launcher checks it against the visible ones)."""
    return None if local_rank is None else f"gpu:{local_rank}"


def block_addresses(hosts: Sequence[str], counts: Sequence[int], base_port: int) -> List[str]:
    """Rank order over nodes: `counts[i]` tasks on `hosts[i]`, at base_port + the task's local index."""
    return [f"{host}:{base_port + local}" for host, n in zip(hosts, counts) for local in range(n)]


def count(env: Mapping[str, str], name: str, what: str, required: bool = False, minimum: int = 0,
          fix: str = "") -> Optional[int]:
    """An integer variable; the error names it, its value, what it means and the fix."""
    raw = (env.get(name) or "").strip()
    if not raw:
        if required:
            raise SchedulerError(f"{name} is not set: it gives {what}{'; ' + fix if fix else ''}")
        return None
    if not raw.isdigit() or int(raw) < minimum:
        raise SchedulerError(f"{name}={raw!r}: expected {what}, an integer >= {minimum}")
    return int(raw)


def text(env: Mapping[str, str], name: str, what: str, fix: str = "") -> str:
    """A variable that must be set; the error names it, what it gives and the fix."""
    raw = (env.get(name) or "").strip()
    if not raw:
        raise SchedulerError(f"{name} is not set: it gives {what}{'; ' + fix if fix else ''}")
    return raw


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if raw not in _TRUE + _FALSE:
        raise SchedulerError(f"{name}={env.get(name)!r}: expected 1 or 0 (true/false, yes/no)")
    return raw in _TRUE
