"""One slot of a scheduler's job: `srun -n 3 towerflow launch --ps 1 SCRIPT`, `mpirun -n 3 ...`, a pod.

The scheduler starts one launcher per slot; each resolves which task of the job it is
(`cluster/schedulers`, with the roles of `--ps N` / `--chief` / `--evaluator`), gathers the
addresses at runtime where the scheduler does not say them (`cluster/membership/gather.py`), and runs that
one task as `plan_one` runs a task of a cluster file: the same environment contract, its address
bound from its own cluster entry, ps tasks running `python -m towerflow.ps.serve`. The device hint
of the resolver (`gpu:<local rank>`) becomes TOWERFLOW_DEVICE only when this machine has that GPU.
"""

from __future__ import annotations

from typing import Callable, List, Mapping, Optional, Sequence

from towerflow import taskenv as _te
from towerflow.cluster import addresses as _addresses
from towerflow.cluster import schedulers as _schedulers
from towerflow.cluster.schedulers import Resolved, Roles
from towerflow.cluster.spec import ClusterSpec
from towerflow.launch import environment as _env
from towerflow.launch.local import LaunchPlan, argv_of, interface_environment, replica_master
from towerflow.launch.task_process import TaskProcessSpec

# What the launcher inherits from a scheduler but its task must not: the scheduler's own ranks (a ps task
# is in no process group) and the role settings, which the task's TF_CONFIG now answers.
NOT_INHERITED = (_te.ENV_RANK, _te.ENV_LOCAL_RANK, _te.ENV_LOCAL_WORLD_SIZE, "GROUP_RANK", "ROLE_RANK",
                 "TORCHELASTIC_USE_AGENT_STORE", _te.ENV_PS_TASKS, _te.ENV_CHIEF, _te.ENV_EVALUATOR, _te.ENV_SCHEDULER)


def resolve_slot(env: Mapping[str, str], scheduler: Optional[str] = None,
                 roles: Optional[Roles] = None) -> Optional[Resolved]:
    """This process's task of the scheduler's job (`env`: `TaskContext.scheduler_env`); None: no scheduler.

    `scheduler` (else TOWERFLOW_SCHEDULER) forces a resolver, or `none` ignores any. A TF_CONFIG or
    TOWERFLOW_JOB_NAME is not a scheduler here: `--cluster FILE` launches one task of a TF_CONFIG cluster.
    """
    return _schedulers.resolve_scheduler(env, scheduler, roles)


def plan_scheduled(script_argv: List[str], resolved: Resolved, logdir: Optional[str] = None,
                   ps_argv: Optional[Sequence[str]] = None, master_port: Optional[int] = None,
                   gpus: Optional[Callable[[], int]] = None, store: Optional[str] = None) -> LaunchPlan:
    """This slot's task of `resolved` (its cluster known: `gather.complete` first when it is not).

    `gpus` counts this machine's GPUs (default: the devices layer's count), for the device hint;
    `store` (etcd://...) holds the rendezvous instead of the coordinator task.
    """
    env = slot_environment(resolved, logdir=logdir, master_port=master_port, gpus=gpus, store=store)
    job, index = resolved.job_name, resolved.task_index
    return LaunchPlan(ClusterSpec(resolved.cluster),
                      [TaskProcessSpec(job, index, argv_of(job, script_argv, ps_argv), env, NOT_INHERITED)])


def slot_environment(resolved: Resolved, logdir: Optional[str] = None, master_port: Optional[int] = None,
                     gpus: Optional[Callable[[], int]] = None, store: Optional[str] = None) -> dict:
    """The environment contract for this slot's task (what `plan_one` gives a task of a cluster file)."""
    cluster = resolved.cluster_spec()
    job, index = resolved.job_name, resolved.task_index
    if resolved.address is None:  # a TFJob's evaluator: not part of the training cluster, as in TensorFlow
        return _env.outside_environment(cluster, job, index, logdir=logdir)
    binding = _addresses.binding_for(cluster, job, index)
    master_addr, master_port = replica_master(cluster, master_port)
    replica = (job, index) in [(t.job, t.task) for t in cluster.replicas()]
    device = _device(resolved.device, gpus) if replica else None
    env = _env.task_environment(cluster, job, index, master_addr=master_addr, master_port=master_port, logdir=logdir,
                                device=device, store=store)
    env.update(interface_environment(binding))
    return env


def _device(hint: Optional[str], gpus: Optional[Callable[[], int]]) -> Optional[str]:
    """'gpu:1' -> '/device:GPU:1' when this machine has a GPU 1; None otherwise (the task picks its own)."""
    if not hint or not hint.startswith("gpu:"):
        return None
    if gpus is None:
        from towerflow.devices.physical import gpu_count as gpus
    index = int(hint.split(":", 1)[1])
    return f"/device:GPU:{index}" if index < gpus() else None
