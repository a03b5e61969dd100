"""The environment contract between `towerflow launch` and each task, written down in one place.

The launcher calls `task_environment()` to build each child's variables; a task calls
`read_task()` to find out which cluster it is in and which task it is. docs/architecture.md
lists the same variables for readers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, Mapping, Optional, Sequence

from towerflow.cluster.spec import ClusterSpec, _same_place, parse_flags, parse_tf_config, split_address
from towerflow.devices.logical import ENV_JOB_NAME, ENV_TASK_INDEX
from towerflow.errors import ClusterSpecError

# towerflow's own variables
ENV_LOGDIR = "TOWERFLOW_LOGDIR"  # --logdir, handed to every task
ENV_DEVICE = "TOWERFLOW_DEVICE"  # the local device a replica should use (--devices / --nproc)
ENV_CLUSTER_TOKEN = "TOWERFLOW_CLUSTER_TOKEN"  # the secret every task presents when it joins
ENV_CLUSTER_TOKEN_FILE = "TOWERFLOW_CLUSTER_TOKEN_FILE"  # ... or a file holding it
ENV_JOIN_TIMEOUT = "TOWERFLOW_JOIN_TIMEOUT"  # seconds a task waits for the others (default 60)
ENV_HEARTBEAT_TIMEOUT = "TOWERFLOW_HEARTBEAT_TIMEOUT"  # seconds of silence before a task counts as dead (default 15)
ENV_RESTART_COUNT = "TOWERFLOW_RESTART_COUNT"  # how many times the launcher restarted this task
ENV_MAX_RESTARTS = "TOWERFLOW_MAX_RESTARTS"  # how many restarts the launcher allows each task (--max-restarts)
ENV_RESTARTED_AT = "TOWERFLOW_RESTARTED_AT"  # time.time() when the launcher saw the previous incarnation die
ENV_RPC_TRANSPORTS = "TOWERFLOW_RPC_TRANSPORTS"  # TensorPipe transports for RPC, e.g. "uv,ibv" (default "uv")
ENV_STORE = "TOWERFLOW_STORE"  # host:port of the rendezvous store when the launcher hosts it (not a task)
ENV_ERROR_FILE = "TOWERFLOW_ERROR_FILE"  # where a failing task leaves its FailureReport for the launcher
# PyTorch's: CPU tensors of 2 MB and more on transparent huge pages (read once, at the first allocation)
ENV_THP_ALLOC = "THP_MEM_ALLOC_ENABLE"
# What a task of a cluster with ps tasks gets unless the launching environment sets the variable.
# Every push and pull lands in a buffer the RPC layer allocates fresh. glibc's own rule (a dynamic
# mmap threshold; big chunks mapped fresh and unmapped on free) hands most of them out as fresh
# pages, a fault per 4 KB; a fixed 32 MB threshold (glibc's cap) with 256 MB of freed memory kept serves the smaller
# ones from reused heap memory, and huge pages make the fresh 32 MB+ ones cheap. Measured in
# docs/benchmarks.md (4 / 16 / 64 MB push+pull: 0.56 / 0.96 / 1.14 -> 0.74 / 1.25 / 1.03 of raw TCP).
# TOWERFLOW_PS_ALLOCATOR=system leaves the allocator as the system has it (glibc's dynamic threshold
# cannot be asked for by value).
ENV_PS_ALLOCATOR = "TOWERFLOW_PS_ALLOCATOR"
PS_ALLOCATOR_CHOICES = ("tuned", "system")
PS_ALLOCATOR_ENV = {
    ENV_THP_ALLOC: "1",
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),
}
# TensorFlow's
ENV_TF_CONFIG = "TF_CONFIG"
# torchrun's, for the process group of training replicas (chief, then workers; no ps)
ENV_RANK, ENV_WORLD_SIZE, ENV_LOCAL_RANK, ENV_LOCAL_WORLD_SIZE = "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"
ENV_MASTER_ADDR, ENV_MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"

CONTRACT = (
    ENV_JOB_NAME,
    ENV_TASK_INDEX,
    ENV_TF_CONFIG,
    ENV_RANK,
    ENV_WORLD_SIZE,
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_LOGDIR,
    ENV_DEVICE,
    ENV_CLUSTER_TOKEN,
    ENV_STORE,
)


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    """Which cluster this process belongs to and which task of it it is."""

    cluster: ClusterSpec
    job_name: str
    task_index: int
    source: str  # where it was read from: 'flags', 'TF_CONFIG', 'TOWERFLOW_*', 'torchrun'

    @property
    def name(self) -> str:
        return f"/job:{self.job_name}/task:{self.task_index}"


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
        ENV_JOB_NAME: job_name,
        ENV_TASK_INDEX: str(task_index),
        ENV_TF_CONFIG: json.dumps({"cluster": cluster.as_dict(), "task": {"type": job_name, "index": task_index}}),
        ENV_MASTER_ADDR: master_addr,
        ENV_MASTER_PORT: str(master_port),
    }
    replicas = [(t.job, t.task) for t in cluster.replicas()]
    env[ENV_WORLD_SIZE] = str(len(replicas))
    if (job_name, task_index) in replicas:  # ps tasks are not in the replicas' process group
        env[ENV_RANK] = str(replicas.index((job_name, task_index)))
        # LOCAL_*: among the replicas whose address names this task's host, as torchrun counts them
        host = _host_of(cluster, job_name, task_index)
        local = [r for r in replicas if _host_of(cluster, *r) == host]
        env[ENV_LOCAL_RANK] = str(local.index((job_name, task_index)))
        env[ENV_LOCAL_WORLD_SIZE] = str(len(local))
    if logdir:
        env[ENV_LOGDIR] = logdir
    if device:
        env[ENV_DEVICE] = device
    if token:
        env[ENV_CLUSTER_TOKEN] = token
    if store:
        env[ENV_STORE] = store
    inherited = os.environ if inherited is None else inherited
    if "ps" in cluster.jobs and _ps_allocator(inherited) == "tuned":
        env.update({k: v for k, v in PS_ALLOCATOR_ENV.items() if k not in inherited})
    return env


def _ps_allocator(env: Mapping[str, str]) -> str:
    choice = env.get(ENV_PS_ALLOCATOR) or "tuned"
    if choice not in PS_ALLOCATOR_CHOICES:
        raise ClusterSpecError(
            f"{ENV_PS_ALLOCATOR}={choice!r}: expected one of {', '.join(PS_ALLOCATOR_CHOICES)} "
            f"(system: launch ps clusters without towerflow's allocator settings {sorted(PS_ALLOCATOR_ENV)})"
        )
    return choice


def _host_of(cluster: ClusterSpec, job: str, index: int) -> str:
    return _same_place(split_address(cluster.task_address(job, index))[0])


def read_task(argv: Optional[Sequence[str]] = None, env: Optional[Mapping[str, str]] = None) -> TaskInfo:
    """Find this task from, in order: the seeds' flags in argv, TF_CONFIG (+ TOWERFLOW_*), torchrun's variables."""
    env = os.environ if env is None else env
    spec, job, index = parse_flags(argv) if argv is not None else (None, None, None)
    if spec is not None:
        if job is None or index is None:
            raise ClusterSpecError(
                "--ps_hosts/--worker_hosts were given without --job_name and --task_index; add e.g. "
                "'--job_name worker --task_index 0'"
            )
        return _checked(TaskInfo(spec, job, index, "flags"))
    if env.get(ENV_TF_CONFIG):
        cluster, tf_job, tf_index = parse_tf_config(env[ENV_TF_CONFIG])
        job = env.get(ENV_JOB_NAME) or tf_job
        raw = env.get(ENV_TASK_INDEX)
        index = int(raw) if raw and raw.isdigit() else tf_index
        if job is None or index is None:
            raise ClusterSpecError(
                "TF_CONFIG names a cluster but not this task; add \"task\": {\"type\": ..., \"index\": ...} or set "
                f"{ENV_JOB_NAME} and {ENV_TASK_INDEX}"
            )
        return _checked(TaskInfo(ClusterSpec(cluster), job, index, "TF_CONFIG"))
    if env.get(ENV_WORLD_SIZE) and env.get(ENV_MASTER_ADDR):
        rank = env.get(ENV_RANK, "0")
        if not rank.isdigit():
            raise ClusterSpecError(f"bad RANK {rank!r}: expected a non-negative integer")
        return _checked(TaskInfo(ClusterSpec.from_torchrun(env), "worker", int(rank), "torchrun"))
    raise ClusterSpecError(
        "this process is not part of a cluster: no --ps_hosts/--worker_hosts flags, no TF_CONFIG and no torchrun "
        "variables. Start it with `towerflow launch`, or pass towerflow.Server(cluster, job_name=..., task_index=...)."
    )


def _checked(info: TaskInfo) -> TaskInfo:
    info.cluster.task_address(info.job_name, info.task_index)  # unknown job / index out of range fail here
    return info


DEFAULT_JOIN_TIMEOUT = 60.0
DEFAULT_HEARTBEAT_TIMEOUT = 15.0


def join_timeout(env: Optional[Mapping[str, str]] = None) -> float:
    """TOWERFLOW_JOIN_TIMEOUT: seconds a task waits for the others to come up (default 60)."""
    return _seconds(ENV_JOIN_TIMEOUT, DEFAULT_JOIN_TIMEOUT, env)


def heartbeat_timeout(env: Optional[Mapping[str, str]] = None) -> float:
    """TOWERFLOW_HEARTBEAT_TIMEOUT: seconds of silence before a task counts as dead (default 15)."""
    return _seconds(ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT, env)


def _seconds(name: str, default: float, env: Optional[Mapping[str, str]]) -> float:
    env = os.environ if env is None else env
    raw = env.get(name) or ""
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ClusterSpecError(f"{name}={raw!r}: expected a positive number of seconds (default {default:g}); "
                               "unset it for the default")
    return value


def read_token(token: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The cluster token: an explicit one, else TOWERFLOW_CLUSTER_TOKEN, else the file TOWERFLOW_CLUSTER_TOKEN_FILE."""
    env = os.environ if env is None else env
    if token:
        return token
    if env.get(ENV_CLUSTER_TOKEN):
        return env[ENV_CLUSTER_TOKEN]
    path = env.get(ENV_CLUSTER_TOKEN_FILE)
    if path:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError as e:
            raise ClusterSpecError(f"cannot read the cluster token file {path!r} ({ENV_CLUSTER_TOKEN_FILE}): {e.strerror}") from None
        if not text:
            raise ClusterSpecError(f"the cluster token file {path!r} ({ENV_CLUSTER_TOKEN_FILE}) is empty")
        return text
    return None
