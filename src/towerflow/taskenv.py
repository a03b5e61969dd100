"""The task environment contract, read in one place.

`towerflow launch` (launch/environment.py) writes these variables for each task; torchrun, a
scheduler or a user may set some of them too. An entry point parses them once (`from_environment()`,
or `read(mapping)`) into a validated `TaskContext` and hands it down; no module keeps one of its own
or reads `os.environ` itself, so there is one TF_CONFIG parser, one chief rule, one set of defaults
and one set of error messages. docs/architecture.md, "The environment contract", lists the same variables.

This module sits at the bottom of the layers (it imports only `errors` and the etcd URL grammar), so
the devices layer can name `/job:x/task:y` without knowing about clusters.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Mapping, Optional, Tuple

from towerflow.errors import TaskEnvironmentError
from towerflow.etcd_url import parse_etcd_url

# ---- the variables (docs/architecture.md keeps the table)
ENV_JOB_NAME = "TOWERFLOW_JOB_NAME"  # this task's job (the launcher; also TF_CONFIG's task type)
ENV_TASK_INDEX = "TOWERFLOW_TASK_INDEX"  # this task's index in its job
ENV_TF_CONFIG = "TF_CONFIG"  # TensorFlow's {"cluster": {...}, "task": {"type": ..., "index": ...}}
ENV_RANK, ENV_WORLD_SIZE = "RANK", "WORLD_SIZE"  # torchrun's: the replicas' process group (no ps)
ENV_LOCAL_RANK, ENV_LOCAL_WORLD_SIZE = "LOCAL_RANK", "LOCAL_WORLD_SIZE"
ENV_MASTER_ADDR, ENV_MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
ENV_LOGDIR = "TOWERFLOW_LOGDIR"  # --logdir, handed to every task
ENV_DEVICE = "TOWERFLOW_DEVICE"  # the local device a replica should use (--devices / --nproc)
ENV_STRATEGY = "TOWERFLOW_STRATEGY"  # optional override of strategy_from_env()'s choice
ENV_CLUSTER_TOKEN = "TOWERFLOW_CLUSTER_TOKEN"  # the secret every task presents when it joins
ENV_CLUSTER_TOKEN_FILE = "TOWERFLOW_CLUSTER_TOKEN_FILE"  # ... or a file holding it
ENV_JOIN_TIMEOUT = "TOWERFLOW_JOIN_TIMEOUT"  # seconds a task waits for the others (default 60)
ENV_HEARTBEAT_TIMEOUT = "TOWERFLOW_HEARTBEAT_TIMEOUT"  # seconds of silence before a task counts as dead (15)
ENV_RESTART_COUNT = "TOWERFLOW_RESTART_COUNT"  # how many times the launcher restarted this task
ENV_MAX_RESTARTS = "TOWERFLOW_MAX_RESTARTS"  # how many restarts the launcher allows each task
ENV_RESTARTED_AT = "TOWERFLOW_RESTARTED_AT"  # time.time() when the launcher saw the previous incarnation die
ENV_LAUNCH_ID = "TOWERFLOW_LAUNCH_ID"  # the launcher's own random id, the same for every incarnation of its tasks
ENV_WIRE_SECURITY = "TOWERFLOW_WIRE_SECURITY"  # encrypt (CURVE) | authenticate (token-derived password); default by the cluster's hosts
ENV_STORE = "TOWERFLOW_STORE"  # the rendezvous store: host:port when the launcher hosts it, or etcd://...
ENV_ERROR_FILE = "TOWERFLOW_ERROR_FILE"  # where a failing task leaves its FailureReport for the launcher
ENV_PS_MODE = "TOWERFLOW_PS_MODE"  # async | sync | ssp (towerflow launch --mode)
ENV_PS_REPLICAS_TO_AGGREGATE = "TOWERFLOW_PS_REPLICAS_TO_AGGREGATE"  # --replicas-to-aggregate
ENV_PS_STALENESS = "TOWERFLOW_PS_STALENESS"  # --staleness
ENV_PS_REPLICAS = "TOWERFLOW_PS_REPLICAS"  # --ps-replicas: copies of each ps task's part (1, or 2 with a backup)
ENV_PS_REPLICA_LAG = "TOWERFLOW_PS_REPLICA_LAG"  # --ps-replica-lag: ops a reply may run ahead of the backup
ENV_PS_PROMOTE_AFTER = "TOWERFLOW_PS_PROMOTE_AFTER"  # seconds a lost primary's restart is awaited before its backup serves
ENV_TOWERS_ALLOCATOR = "TOWERFLOW_TOWERS_ALLOCATOR"  # keep (default: towers keep freed memory for the next step) | system
ENV_PS_LINK = "TOWERFLOW_PS_LINK"  # shm (default: same-host ps traffic through shared memory) | zmq (always calls over ZeroMQ)
ENV_PS_LOCAL_STEPS = "TOWERFLOW_PS_LOCAL_STEPS"  # --local-steps (geo: k local steps per push of a delta)
ENV_PS_DENSE = "TOWERFLOW_PS_DENSE"  # --dense: ps (every parameter on the ps tasks) | allreduce (only the tables there)
ENV_PS_PUBLISH_EVERY = "TOWERFLOW_PS_PUBLISH_EVERY"  # --publish-every S: ps tasks publish changed rows every S seconds
ENV_PS_PUBLISH_TO = "TOWERFLOW_PS_PUBLISH_TO"  # --publish-to DIR: where (default LOGDIR/publish)
ENV_PS_PUBLISH_SNAPSHOT_EVERY = "TOWERFLOW_PS_PUBLISH_SNAPSHOT_EVERY"  # --snapshot-every K (unset: by volume)
ENV_PROFILE_FROM = "TOWERFLOW_PROFILE_FROM"  # --profile-steps START: profile each task from this global step on
ENV_PROFILE_STEPS = "TOWERFLOW_PROFILE_STEPS"  # --profile-steps START:COUNT: how many of its steps
ENV_OMP_NUM_THREADS = "OMP_NUM_THREADS"  # set by the user: towerflow then leaves torch's thread count alone
ENV_SCHEDULER = "TOWERFLOW_SCHEDULER"  # which scheduler resolver to use instead of detecting one (cluster/schedulers)
ENV_PS_TASKS = "TOWERFLOW_PS_TASKS"  # how many of a scheduler's ranks are ps tasks (roles; `towerflow cluster --ps`)
ENV_CHIEF = "TOWERFLOW_CHIEF"  # 1: a scheduler's first rank is the chief (roles)
ENV_EVALUATOR = "TOWERFLOW_EVALUATOR"  # 1: one of a scheduler's ranks is the evaluator (roles)
ENV_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # torchrun's: True when its agent serves the store at MASTER_PORT
# What a scheduler sets, captured whole for the resolvers (cluster/schedulers): these prefixes and names,
# and the variables above that they read as well (torchrun's, TF_CONFIG, this task's job, the role settings).
SCHEDULER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "PET_", "TORCHELASTIC_", "SKYPILOT_", "JSM_NAMESPACE_")
SCHEDULER_VARIABLES = ("GROUP_RANK", "ROLE_RANK", "KUBERNETES_SERVICE_HOST", "SLURMD_NODENAME", ENV_SCHEDULER, ENV_PS_TASKS, ENV_CHIEF,
                       ENV_EVALUATOR, ENV_TF_CONFIG, ENV_JOB_NAME, ENV_TASK_INDEX, ENV_RANK, ENV_WORLD_SIZE,
                       ENV_LOCAL_RANK, ENV_LOCAL_WORLD_SIZE, ENV_MASTER_ADDR, ENV_MASTER_PORT)
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

DEFAULT_JOIN_TIMEOUT = 60.0
DEFAULT_HEARTBEAT_TIMEOUT = 15.0
DEFAULT_PS_PROMOTE_AFTER = 5.0  # a restarted ps task on a live host is back in 2-5 s (docs/fault-tolerance.md)
WIRE_SECURITY = ("encrypt", "authenticate")  # cluster/calls/wire_security.py
PS_MODES = ("async", "sync", "ssp")
PS_DENSE = ("ps", "allreduce")
MAX_PS_REPLICAS = 2  # a primary and one backup
PS_LINKS = ("shm", "zmq")
TOWERS_ALLOCATORS = ("keep", "system")


@dataclasses.dataclass(frozen=True)
class TaskIdentity:
    """Which task this process is: its job and index, its cluster, its replica-group ranks, its incarnation."""

    job_name: Optional[str] = None  # TOWERFLOW_JOB_NAME, else TF_CONFIG's task type
    task_index: Optional[int] = None  # TOWERFLOW_TASK_INDEX, else TF_CONFIG's task index
    cluster: Mapping[str, List[str]] = dataclasses.field(default_factory=dict)  # TF_CONFIG's, not validated yet
    rank: Optional[int] = None
    world_size: Optional[int] = None
    local_rank: Optional[int] = None
    local_world_size: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    device: Optional[str] = None  # the local device a replica should use
    restart_count: int = 0
    restarted_at: Optional[float] = None
    launch_id: Optional[str] = None  # which launcher started this task (a restart finds its run by it: ending.py)

    @property
    def has_task(self) -> bool:
        return self.job_name is not None and self.task_index is not None

    @property
    def is_chief(self) -> bool:
        """TF's rule for this process (see `is_chief_task`); a plain process is its own chief."""
        return is_chief_task(self.job_name or "localhost", self.task_index or 0, self.cluster)


@dataclasses.dataclass(frozen=True)
class JoinSettings:
    """How this task joins the others: the token, the store, the timeouts, the restarts it is allowed."""

    token: Optional[str] = None
    token_file: Optional[str] = None
    store: Optional[str] = None
    error_file: Optional[str] = None
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    max_restarts: int = 0
    wire_security: Optional[str] = None  # None: encrypt across hosts, authenticate on loopback

    def cluster_token(self) -> Optional[str]:
        """TOWERFLOW_CLUSTER_TOKEN, else the contents of TOWERFLOW_CLUSTER_TOKEN_FILE, else None."""
        if self.token:
            return self.token
        if not self.token_file:
            return None
        try:
            with open(self.token_file) as f:
                text = f.read().strip()
        except OSError as e:
            raise TaskEnvironmentError(
                f"cannot read the cluster token file {self.token_file!r} ({ENV_CLUSTER_TOKEN_FILE}): {e.strerror}"
            ) from None
        if not text:
            raise TaskEnvironmentError(f"the cluster token file {self.token_file!r} ({ENV_CLUSTER_TOKEN_FILE}) is empty")
        return text


@dataclasses.dataclass(frozen=True)
class PsOptions:
    """The parameter-server options `towerflow launch` hands every task (--mode, --ps-replicas, ...)."""

    mode: Optional[str] = None
    replicas_to_aggregate: Optional[int] = None
    staleness: Optional[int] = None
    replicas: Optional[int] = None
    replica_lag: Optional[int] = None
    promote_after: float = DEFAULT_PS_PROMOTE_AFTER
    link: str = "shm"  # TOWERFLOW_PS_LINK: how a worker reaches a ps task of its own host
    local_steps: Optional[int] = None
    dense: Optional[str] = None  # TOWERFLOW_PS_DENSE: where the non-table parameters train
    publish_every: Optional[float] = None  # seconds between the ps tasks' publications of changed rows (None: off)
    publish_to: Optional[str] = None  # the folder they publish to (None: LOGDIR/publish)
    publish_snapshot_every: Optional[int] = None  # a file snapshot after every K deltas (None: by volume)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How this task runs: the strategy asked for, where it writes, threads, allocator, profiling."""

    strategy: Optional[str] = None
    logdir: Optional[str] = None
    towers_allocator: str = "keep"  # TOWERFLOW_TOWERS_ALLOCATOR: whether towers in one process tune glibc malloc
    profile_from: Optional[int] = None  # a MonitoredTrainingSession profiles its steps from this global step on
    profile_steps: Optional[int] = None
    threads_set_by_user: bool = False  # OMP_NUM_THREADS is set: do not split the CPU's cores
    socket_ifnames: Mapping[str, str] = dataclasses.field(default_factory=dict)  # the ones already set


@dataclasses.dataclass(frozen=True)
class TaskContext:
    """Everything the launcher (or torchrun, or a scheduler) told this process, parsed once and passed down."""

    identity: TaskIdentity = dataclasses.field(default_factory=TaskIdentity)
    join: JoinSettings = dataclasses.field(default_factory=JoinSettings)
    ps: PsOptions = dataclasses.field(default_factory=PsOptions)
    tuning: Tuning = dataclasses.field(default_factory=Tuning)
    scheduler_env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # scheduler_variables(env): for the resolvers

    @property
    def has_task(self) -> bool:
        return self.identity.has_task

    @property
    def is_chief(self) -> bool:
        return self.identity.is_chief

    @property
    def agent_store_prefix(self) -> Optional[str]:
        """Under torchrun, whose agent already serves a store at MASTER_ADDR:MASTER_PORT
        (TORCHELASTIC_USE_AGENT_STORE=True), the replicas meet in it as clients, under this prefix (one per
        run and restart of the worker group); None: rank 0 hosts the replicas' store itself."""
        env = self.scheduler_env
        if env.get(ENV_AGENT_STORE) != "True":
            return None
        return f"towerflow/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def as_task(self, job: str, index: int) -> "TaskContext":
        """This context for a process that serves as `/job:<job>/task:<index>` (a Server's own task)."""
        return dataclasses.replace(self, identity=dataclasses.replace(self.identity, job_name=job, task_index=index))


def is_chief_task(job: str, index: int, jobs) -> bool:
    """TF's rule: the `chief` task, or worker 0 when the cluster has no chief job (a plain process too)."""
    if job == "chief":
        return True
    return job in ("worker", "localhost") and index == 0 and "chief" not in jobs


def from_environment() -> TaskContext:
    """This process's environment, parsed now. An entry point (a Server, `strategy_from_env`, `python -m
    towerflow.ps.serve`, `towerflow launch`, `towerflow cluster`) calls it once and passes the context down;
    a script may set TF_CONFIG itself before it starts its task, as TensorFlow's guides do."""
    return read(os.environ)


def read(env: Mapping[str, str]) -> TaskContext:
    """Parse and check the contract in `env`; every error names the variable, its value and the fix."""
    cluster, tf_job, tf_index = parse_tf_config(env.get(ENV_TF_CONFIG, ""), required=False)
    world = _count(env, ENV_WORLD_SIZE, minimum=1)
    rank = _count(env, ENV_RANK)
    if rank is not None and rank >= (world or 1):
        raise TaskEnvironmentError(f"{ENV_RANK}={rank} with {ENV_WORLD_SIZE}={world or 1}: expected RANK < WORLD_SIZE "
                                   "(both are set by the launcher or torchrun)")
    index = _count(env, ENV_TASK_INDEX)
    return TaskContext(
        identity=TaskIdentity(
            job_name=env.get(ENV_JOB_NAME) or tf_job,
            task_index=index if index is not None else tf_index,
            cluster=cluster,
            rank=rank,
            world_size=world,
            local_rank=_count(env, ENV_LOCAL_RANK),
            local_world_size=_count(env, ENV_LOCAL_WORLD_SIZE, minimum=1),
            master_addr=env.get(ENV_MASTER_ADDR) or None,
            master_port=_port(env),
            device=env.get(ENV_DEVICE) or None,
            restart_count=_count(env, ENV_RESTART_COUNT) or 0,
            restarted_at=_time(env, ENV_RESTARTED_AT),
            launch_id=env.get(ENV_LAUNCH_ID) or None,
        ),
        join=JoinSettings(
            token=env.get(ENV_CLUSTER_TOKEN) or None,
            token_file=env.get(ENV_CLUSTER_TOKEN_FILE) or None,
            store=_store(env),
            error_file=env.get(ENV_ERROR_FILE) or None,
            join_timeout=_seconds(env, ENV_JOIN_TIMEOUT, DEFAULT_JOIN_TIMEOUT),
            heartbeat_timeout=_seconds(env, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT),
            max_restarts=_count(env, ENV_MAX_RESTARTS) or 0,
            wire_security=_choice(env, ENV_WIRE_SECURITY, WIRE_SECURITY),
        ),
        ps=PsOptions(
            mode=_choice(env, ENV_PS_MODE, PS_MODES),
            replicas_to_aggregate=_count(env, ENV_PS_REPLICAS_TO_AGGREGATE, minimum=1),
            staleness=_count(env, ENV_PS_STALENESS),
            replicas=_count(env, ENV_PS_REPLICAS, minimum=1),
            replica_lag=_count(env, ENV_PS_REPLICA_LAG, minimum=0),
            promote_after=_seconds(env, ENV_PS_PROMOTE_AFTER, DEFAULT_PS_PROMOTE_AFTER),
            link=_choice(env, ENV_PS_LINK, PS_LINKS) or "shm",
            local_steps=_count(env, ENV_PS_LOCAL_STEPS, minimum=1),
            dense=_choice(env, ENV_PS_DENSE, PS_DENSE),
            publish_every=_seconds(env, ENV_PS_PUBLISH_EVERY, 0.0) or None,
            publish_to=env.get(ENV_PS_PUBLISH_TO) or None,
            publish_snapshot_every=_count(env, ENV_PS_PUBLISH_SNAPSHOT_EVERY, minimum=1),
        ),
        tuning=Tuning(
            strategy=env.get(ENV_STRATEGY) or None,
            logdir=env.get(ENV_LOGDIR) or None,
            towers_allocator=_choice(env, ENV_TOWERS_ALLOCATOR, TOWERS_ALLOCATORS) or "keep",
            profile_from=_count(env, ENV_PROFILE_FROM),
            profile_steps=_count(env, ENV_PROFILE_STEPS, minimum=1),
            threads_set_by_user=ENV_OMP_NUM_THREADS in env,
            socket_ifnames={k: env[k] for k in SOCKET_IFNAME_VARIABLES if env.get(k)},
        ),
        scheduler_env=scheduler_variables(env),
    )


def scheduler_variables(env: Mapping[str, str]) -> Dict[str, str]:
    """The variables of `env` a scheduler resolver may read (SCHEDULER_PREFIXES, SCHEDULER_VARIABLES), sorted."""
    return {k: env[k] for k in sorted(env) if k.startswith(SCHEDULER_PREFIXES) or k in SCHEDULER_VARIABLES}


def parse_tf_config(text: str, required: bool = True) -> Tuple[Dict[str, List[str]], Optional[str], Optional[int]]:
    """TF_CONFIG text -> (cluster dict, task type, task index); errors quote the bad part.

    As TensorFlow reads it: unset, '{}' or one without "cluster" is no cluster (unless
    `required`); a present "cluster" must be a dict and a present "task" a dict with an integer index.
    """
    if not text or not text.strip():
        if not required:
            return {}, None, None
        raise TaskEnvironmentError("TF_CONFIG is empty; expected {\"cluster\": {...}, \"task\": {\"type\": ..., \"index\": ...}}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskEnvironmentError(f"TF_CONFIG is not valid JSON ({e}): {text[:200]!r}") from None
    if not isinstance(data, dict):
        raise TaskEnvironmentError(f"TF_CONFIG must be a JSON object like {{\"cluster\": {{...}}}}: {text[:200]!r}")
    cluster = data.get("cluster")
    if cluster is None and not required:  # TF's resolvers: no "cluster" is an empty ClusterSpec, not distributed
        return {}, None, None
    if not isinstance(cluster, dict):
        raise TaskEnvironmentError(f"TF_CONFIG has no \"cluster\" dict: {text[:200]!r}")
    task = data.get("task") or {}
    if not isinstance(task, dict):
        raise TaskEnvironmentError(f"TF_CONFIG's \"task\" must be a dict like {{\"type\": \"worker\", \"index\": 0}}, got {task!r}")
    index = task.get("index", 0 if task.get("type") else None)
    if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
        if isinstance(index, str) and index.isdigit():
            index = int(index)
        else:
            raise TaskEnvironmentError(f"TF_CONFIG task index {index!r} is not a non-negative integer")
    return cluster, task.get("type"), index


# ---- value parsers: each error names the variable, the bad value and what was expected
def _count(env: Mapping[str, str], name: str, minimum: int = 0) -> Optional[int]:
    text = (env.get(name) or "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        what = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise TaskEnvironmentError(f"{name}={text!r} in the environment: expected {what} (set by the launcher; "
                                   "unset it or correct it)")
    return value


def _port(env: Mapping[str, str]) -> Optional[int]:
    port = _count(env, ENV_MASTER_PORT)
    if port is not None and not 1 <= port <= 65535:
        raise TaskEnvironmentError(f"{ENV_MASTER_PORT}={port}: expected a port between 1 and 65535")
    return port


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name) or ""
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise TaskEnvironmentError(f"{name}={raw!r}: expected a positive number of seconds (default {default:g}); "
                                   "unset it for the default")
    return value


def _time(env: Mapping[str, str], name: str) -> Optional[float]:
    raw = env.get(name) or ""
    try:
        return float(raw) if raw else None
    except ValueError:
        raise TaskEnvironmentError(f"{name}={raw!r}: expected a time.time() value (set by the launcher)") from None


def _store(env: Mapping[str, str]) -> Optional[str]:
    raw = env.get(ENV_STORE) or None
    if raw is not None and "://" in raw:
        parse_etcd_url(raw, ENV_STORE)  # refused here, naming the variable, rather than when the task joins
    return raw


def _choice(env: Mapping[str, str], name: str, choices: Tuple[str, ...]) -> Optional[str]:
    raw = env.get(name) or None
    if raw is not None and raw not in choices:
        raise TaskEnvironmentError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw
