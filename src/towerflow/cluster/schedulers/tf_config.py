"""TF_CONFIG (and towerflow's own TOWERFLOW_JOB_NAME / TOWERFLOW_TASK_INDEX): every task named by its job.

What `towerflow launch` writes and what a user sets by hand, read by `taskenv` (the one TF_CONFIG
parser). The Kubernetes resolver reads a TFJob's TF_CONFIG through `from_tf_config` too.
"""

from __future__ import annotations

import json
from typing import Mapping, Optional

from towerflow import taskenv as _te
from towerflow.cluster.schedulers.base import Resolved, Roles, SchedulerResolver, gpu_hint
from towerflow.cluster.spec import ClusterSpec, split_address
from towerflow.errors import SchedulerError


def is_kubeflow(env: Mapping[str, str]) -> bool:
    """A Kubeflow TFJob's TF_CONFIG: "environment": "cloud", in a pod."""
    try:
        data = json.loads(env.get(_te.ENV_TF_CONFIG) or "{}")
    except json.JSONDecodeError:
        return False
    return "KUBERNETES_SERVICE_HOST" in env and isinstance(data, dict) and data.get("environment") == "cloud"


def from_tf_config(resolver: SchedulerResolver, env: Mapping[str, str], roles: Roles,
                   local_rank: Optional[int] = None) -> Resolved:
    """The Resolved of a TF_CONFIG: its cluster and task (an evaluator may be outside the cluster, as in TF)."""
    if not roles.is_default:
        raise SchedulerError(
            f"{roles} asked for, but TF_CONFIG already names every task's job; roles apply to schedulers that only "
            f"give ranks (Slurm, MPI, torchrun, PyTorchJob): unset {_te.ENV_PS_TASKS}/{_te.ENV_CHIEF}/"
            f"{_te.ENV_EVALUATOR} and leave out --ps/--chief/--evaluator"
        )
    task = _te.read(env).identity
    if not task.cluster:
        raise SchedulerError(f"{_te.ENV_JOB_NAME}={task.job_name!r} is set but TF_CONFIG names no cluster; set TF_CONFIG "
                             "to {\"cluster\": {...}, \"task\": {...}} or unset it")
    if not task.has_task:
        raise SchedulerError("TF_CONFIG names a cluster but not this task; add \"task\": {\"type\": ..., \"index\": ...} "
                             f"or set {_te.ENV_JOB_NAME} and {_te.ENV_TASK_INDEX}")
    spec = ClusterSpec(task.cluster)
    job, index = task.job_name, task.task_index
    jobs = {j: spec.num_tasks(j) for j in spec.jobs}
    port = None
    if job == "evaluator" and job not in jobs:  # TF: the evaluator is not part of the training cluster
        jobs[job] = 1
    else:
        port = split_address(spec.task_address(job, index), any_port=True)[1] or None  # 0: the task picks it
    lr = task.local_rank if task.local_rank is not None else local_rank
    return Resolved(resolver.name, job, index, jobs, spec.as_dict(), resolver.source(env), task.rank, task.world_size,
                    lr, task.local_world_size, gpu_hint(lr), port, None, task.restart_count)


class TFConfigResolver(SchedulerResolver):
    name = "tf_config"
    reads = (_te.ENV_TF_CONFIG, _te.ENV_JOB_NAME, _te.ENV_TASK_INDEX, "RANK", "WORLD_SIZE", "LOCAL_RANK",
             "LOCAL_WORLD_SIZE")

    def detect(self, env: Mapping[str, str]) -> bool:
        if env.get(_te.ENV_JOB_NAME):
            return True
        try:
            return bool(_te.parse_tf_config(env.get(_te.ENV_TF_CONFIG, ""), required=False)[0]) and not is_kubeflow(env)
        except _te.TaskEnvironmentError:
            return True  # resolve() names what is wrong with it

    def resolve(self, env: Mapping[str, str], roles: Roles) -> Resolved:
        return from_tf_config(self, env, roles)
