"""The launcher's side of the environment contract: what each task it starts is told.

`task_environment()` builds one task's variables (the names and their meaning live in
`towerflow.taskenv`, which is the only place a task reads them); `inherited()` is what every
task gets from the launching shell; `launch_default()` reads the `TOWERFLOW_LAUNCH_*` defaults of
the command line. This and `taskenv` are the only modules that touch `os.environ` (besides the
devices layer, for CUDA's own variables).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, Mapping, Optional

from towerflow import taskenv as _te
from towerflow.cluster.spec import ClusterSpec, canonical_host, split_address
from towerflow.errors import LaunchError
from towerflow.taskenv import (ENV_ERROR_FILE, ENV_LAUNCH_ID, ENV_MAX_RESTARTS, ENV_RESTART_COUNT,  # noqa: F401 (written here)
                               ENV_RESTARTED_AT)

# What a task of a cluster with ps tasks gets unless the launching environment sets the variable.
# Every push and pull lands in a buffer libzmq allocates fresh with malloc (a 17M-parameter model's
# is 68 MB). glibc maps a chunk that large fresh from the kernel and unmaps it on free, so every
# step paid a page fault per 4 KB and the zeroing of every page, twice per worker. With no mmap at
# all (MALLOC_MMAP_MAX_=0), one arena (libzmq's I/O thread would otherwise allocate in an arena of
# its own, whose heaps cannot hold such a chunk and map it anyway) and freed memory kept up to 2 GB,
# the next step's buffer reuses the last one's memory: what strategies/_host_memory.py does for
# towers. The price: a task keeps its peak heap. Measured in docs/parameter-server.md, "Allocator
# settings". TOWERFLOW_PS_ALLOCATOR=system leaves the allocator as the system has it.
ENV_PS_ALLOCATOR = "TOWERFLOW_PS_ALLOCATOR"
ENV_FORK_SERVER = "TOWERFLOW_FORK_SERVER"  # "0": start every task as a fresh interpreter
PS_ALLOCATOR_CHOICES = ("tuned", "system")
ENV_THP_ALLOC = "THP_MEM_ALLOC_ENABLE"  # PyTorch's: CPU tensors of 2 MB and more on transparent huge pages
PS_ALLOCATOR_ENV = {
    ENV_THP_ALLOC: "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_TRIM_THRESHOLD_": str((1 << 31) - 1),
}


def inherited(drop: Iterable[str] = ()) -> Dict[str, str]:
    """The launching shell's environment, but `drop`: every task starts from it."""
    drop = set(drop)
    return {k: v for k, v in os.environ.items() if k not in drop}


def become(env: Mapping[str, str]) -> None:
    """A task forked by the fork server (zygote.py): exactly `env`, nothing of the fork server's own left."""
    os.environ.clear()
    os.environ.update(env)


def fork_server_wanted() -> bool:
    """Whether the launching shell leaves the fork server on (TOWERFLOW_FORK_SERVER, launch/forkserver.py)."""
    return os.environ.get(ENV_FORK_SERVER, "1") != "0"


def launch_default(name: str, default: Optional[str] = None) -> Optional[str]:
    """A `towerflow launch` flag's default from the environment (TOWERFLOW_LAUNCH_*, TOWERFLOW_LOGDIR, ...)."""
    return os.environ.get(name, default)


def launch_default_int(name: str, default: Optional[int] = None) -> Optional[int]:
    value = os.environ.get(name)
    if not value:
        return default
    if not value.isdigit():
        raise LaunchError(f"{name}={value!r}: expected a non-negative integer (the default of a launch flag); "
                          "unset it or correct it")
    return int(value)


def has_token() -> bool:
    """Whether the launching shell names a cluster token (TOWERFLOW_CLUSTER_TOKEN or _FILE)."""
    return bool(os.environ.get(_te.ENV_CLUSTER_TOKEN) or os.environ.get(_te.ENV_CLUSTER_TOKEN_FILE))


def wire_security() -> Optional[str]:
    """The launching shell's TOWERFLOW_WIRE_SECURITY, which every task it starts inherits; None: the tasks' own
    default (encrypt across hosts). TaskEnvironmentError for a value the tasks would refuse."""
    return _te._choice(os.environ, _te.ENV_WIRE_SECURITY, _te.WIRE_SECURITY)


def inherited_token() -> Optional[str]:
    """The launching shell's TOWERFLOW_CLUSTER_TOKEN: the embedded cluster uses it rather than a fresh one."""
    return os.environ.get(_te.ENV_CLUSTER_TOKEN) or None


def unset(names) -> Dict[str, str]:
    """Keep only the variables of `names` (a dict) that the launching shell does not set: the user's choice wins."""
    return {k: v for k, v in names.items() if k not in os.environ}


def export_ps_mode(mode: Optional[str], replicas_to_aggregate: Optional[int], staleness: Optional[int],
                   local_steps: Optional[int] = None, ps_replicas: Optional[int] = None,
                   ps_replica_lag: Optional[int] = None, dense: Optional[str] = None) -> None:
    """--mode/--replicas-to-aggregate/--staleness/--local-steps/--ps-replicas/--ps-replica-lag/--dense: every task
    inherits them as TOWERFLOW_PS_*."""
    for name, value in ((_te.ENV_PS_MODE, mode), (_te.ENV_PS_REPLICAS_TO_AGGREGATE, replicas_to_aggregate),
                        (_te.ENV_PS_STALENESS, staleness), (_te.ENV_PS_LOCAL_STEPS, local_steps),
                        (_te.ENV_PS_REPLICAS, ps_replicas), (_te.ENV_PS_REPLICA_LAG, ps_replica_lag),
                        (_te.ENV_PS_DENSE, dense)):
        if value is not None:
            os.environ[name] = str(value)


def export_publish(every: float, to: str, snapshot_every: Optional[int] = None) -> None:
    """--publish-every S [--publish-to DIR] [--snapshot-every K]: every ps task publishes its changed rows there
    every S seconds (a snapshot after every K deltas; unset: by volume)."""
    os.environ[_te.ENV_PS_PUBLISH_EVERY], os.environ[_te.ENV_PS_PUBLISH_TO] = repr(float(every)), to
    if snapshot_every is None:
        os.environ.pop(_te.ENV_PS_PUBLISH_SNAPSHOT_EVERY, None)
    else:
        os.environ[_te.ENV_PS_PUBLISH_SNAPSHOT_EVERY] = str(int(snapshot_every))


def export_profile(start: int, steps: int) -> None:
    """--profile-steps START:COUNT: every task's MonitoredTrainingSession profiles that window of its steps."""
    os.environ[_te.ENV_PROFILE_FROM], os.environ[_te.ENV_PROFILE_STEPS] = str(start), str(steps)


def task_environment(
    cluster: ClusterSpec,
    job_name: str,
    task_index: int,
    *,
    master_addr: str,
    master_port: int,
    logdir: Optional[str] = None,
    device: Optional[str] = None,
    token: Optional[str] = None,
    store: Optional[str] = None,
    inherited: Optional[Mapping[str, str]] = None,
) -> Dict[str, str]:
    """The variables one launched task gets (see docs/architecture.md, 'The environment contract').

    `inherited` is the launcher's own environment (default `os.environ`), which every task gets too.
    """
    cluster.task_address(job_name, task_index)  # validates the pair
    env = {
        _te.ENV_JOB_NAME: job_name,
        _te.ENV_TASK_INDEX: str(task_index),
        _te.ENV_TF_CONFIG: json.dumps({"cluster": cluster.as_dict(), "task": {"type": job_name, "index": task_index}}),
        _te.ENV_MASTER_ADDR: master_addr,
        _te.ENV_MASTER_PORT: str(master_port),
    }
    replicas = [(t.job, t.task) for t in cluster.replicas()]
    env[_te.ENV_WORLD_SIZE] = str(len(replicas))
    if (job_name, task_index) in replicas:  # ps tasks are not in the replicas' process group
        env[_te.ENV_RANK] = str(replicas.index((job_name, task_index)))
        # LOCAL_*: among the replicas whose address names this task's host, as torchrun counts them
        host = _host_of(cluster, job_name, task_index)
        local = [r for r in replicas if _host_of(cluster, *r) == host]
        env[_te.ENV_LOCAL_RANK] = str(local.index((job_name, task_index)))
        env[_te.ENV_LOCAL_WORLD_SIZE] = str(len(local))
    for name, value in ((_te.ENV_LOGDIR, logdir), (_te.ENV_DEVICE, device), (_te.ENV_CLUSTER_TOKEN, token),
                        (_te.ENV_STORE, store)):
        if value:
            env[name] = value
    inherited = os.environ if inherited is None else inherited
    if "ps" in cluster.jobs and _ps_allocator(inherited) == "tuned":
        env.update({k: v for k, v in PS_ALLOCATOR_ENV.items() if k not in inherited})
    return env


def outside_environment(cluster: ClusterSpec, job_name: str, task_index: int, logdir: Optional[str] = None) -> Dict[str, str]:
    """A task outside the cluster it reads (a TFJob's evaluator, as in TensorFlow): its name and the
    cluster's TF_CONFIG, no address and no place among the replicas."""
    env = {
        _te.ENV_JOB_NAME: job_name,
        _te.ENV_TASK_INDEX: str(task_index),
        _te.ENV_TF_CONFIG: json.dumps({"cluster": cluster.as_dict(), "task": {"type": job_name, "index": task_index}}),
    }
    if logdir:
        env[_te.ENV_LOGDIR] = logdir
    return env


def _ps_allocator(env: Mapping[str, str]) -> str:
    choice = env.get(ENV_PS_ALLOCATOR) or "tuned"
    if choice not in PS_ALLOCATOR_CHOICES:
        raise _te.TaskEnvironmentError(
            f"{ENV_PS_ALLOCATOR}={choice!r}: expected one of {', '.join(PS_ALLOCATOR_CHOICES)} "
            f"(system: launch ps clusters without towerflow's allocator settings {sorted(PS_ALLOCATOR_ENV)})"
        )
    return choice


def _host_of(cluster: ClusterSpec, job: str, index: int) -> str:
    return canonical_host(split_address(cluster.task_address(job, index), any_port=True)[0])
