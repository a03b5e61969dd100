"""Which cluster this process is in and which task of it it is: the seeds' flags, else the task environment.

The variables themselves are parsed in `towerflow.taskenv` (the one reader) and written by the
launcher (`launch/environment.py`); this module turns them into a validated `TaskInfo`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional, Sequence

from towerflow import taskenv as _te
from towerflow.cluster.membership import gather as _gather
from towerflow.cluster import schedulers as _schedulers
from towerflow.cluster.schedulers import Resolved, Roles
from towerflow.cluster.spec import ClusterSpec, parse_flags
from towerflow.errors import ClusterSpecError


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    """Which cluster this process belongs to and which task of it it is."""

    cluster: ClusterSpec
    job_name: str
    task_index: int
    source: str  # where it was read from: 'flags', 'TF_CONFIG', or a scheduler's name ('torchrun', 'env', ...)

    @property
    def name(self) -> str:
        return f"/job:{self.job_name}/task:{self.task_index}"


def read_task(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None,
              context: Optional[_te.TaskContext] = None) -> TaskInfo:
    """Find this task from, in order: the seeds' flags in argv, TF_CONFIG (+ TOWERFLOW_*), and a scheduler's
    variables (cluster/schedulers: Slurm, MPI, Kubernetes, torchrun, or the bare env:// RANK/WORLD_SIZE/MASTER_*,
    with the roles of TOWERFLOW_PS_TASKS / TOWERFLOW_CHIEF / TOWERFLOW_EVALUATOR; addresses gathered at
    runtime where the scheduler does not say them). `context`: this process's, when its entry point built it."""
    spec, job, index = parse_flags(argv) if argv is not None else (None, None, None)
    if spec is not None:
        if job is None or index is None:
            raise ClusterSpecError(
                "--ps_hosts/--worker_hosts were given without --job_name and --task_index; add e.g. "
                "'--job_name worker --task_index 0'"
            )
        return _checked(TaskInfo(spec, job, index, "flags"))
    task = _te.read(env) if env is not None else context if context is not None else _te.from_environment()
    if task.identity.cluster:
        if not task.has_task:
            raise ClusterSpecError(
                "TF_CONFIG names a cluster but not this task; add \"task\": {\"type\": ..., \"index\": ...} or set "
                f"{_te.ENV_JOB_NAME} and {_te.ENV_TASK_INDEX}"
            )
        return _checked(TaskInfo(ClusterSpec(task.identity.cluster), task.identity.job_name, task.identity.task_index, "TF_CONFIG"))
    sources = []
    resolved = scheduled_slot(task, check=lambda r: sources.append(
        r.scheduler if r.cluster is not None else f"{r.scheduler} (gathered)") is None)
    if resolved is not None:  # a plain `srun python SCRIPT`, `mpirun ...`, torchrun, a pod: the scheduler's slot
        return _checked(TaskInfo(ClusterSpec(resolved.cluster), resolved.job_name, resolved.task_index, sources[0]))
    raise ClusterSpecError(
        "this process is not part of a cluster: no --ps_hosts/--worker_hosts flags, no TF_CONFIG and no scheduler's "
        "or torchrun's variables. Start it with `towerflow launch`, or pass towerflow.Server(cluster, job_name=..., "
        "task_index=...)."
    )


def scheduled_slot(task: _te.TaskContext, scheduler: Optional[str] = None, roles: Optional[Roles] = None,
                   check: Optional[Callable[[Resolved], bool]] = None) -> Optional[Resolved]:
    """This process's slot of a scheduler's job, its cluster gathered where the scheduler does not say it; None:
    no scheduler (or `check`, asked before anything is gathered, says False). The one place a process that
    nothing placed yet resolves its scheduler: `read_task`, `strategy_from_env` and `towerflow launch` ask it.
    `scheduler` and `roles` override TOWERFLOW_SCHEDULER and the role settings (cluster/schedulers)."""
    resolved = _schedulers.resolve_scheduler(task.scheduler_env, scheduler, roles)
    if resolved is None or (check is not None and not check(resolved)):
        return None
    return _gather.complete(resolved, task.join.join_timeout, task.scheduler_env)


def _checked(info: TaskInfo) -> TaskInfo:
    info.cluster.task_address(info.job_name, info.task_index)  # unknown job / index out of range fail here
    return info

