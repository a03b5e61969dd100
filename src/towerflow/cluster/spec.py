"""ClusterSpec: which tasks make up a cluster and where they listen, as `tf.train.ClusterSpec`.

One spec is built from any of the ways people describe a cluster (a dict, a JSON file, the
TF seeds' `--ps_hosts/--worker_hosts` flags, `TF_CONFIG`, torchrun's variables) and validated
once, so every later error can name the task and address it is about.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from towerflow.devices.spec import JOB_NAME_PATTERN, DeviceSpec
from towerflow import taskenv as _taskenv
from towerflow.errors import ClusterSpecError, did_you_mean

# Jobs in the order their tasks are numbered (chief first: it coordinates); other jobs follow, sorted.
JOB_ORDER = ("chief", "master", "worker", "ps", "evaluator")
REPLICA_JOBS = ("chief", "master", "worker")  # the training replicas, in process-group order

_LOCAL_NAMES = {"localhost": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::1": "127.0.0.1", "[::1]": "127.0.0.1"}

ClusterLike = Union["ClusterSpec", Mapping[str, Union[Sequence[str], Mapping[int, str]]]]


def split_address(address: str, where: str = "", any_port: bool = False) -> Tuple[str, int]:
    """'host:port' -> (host, port); the error names the address and where it came from.

    `any_port` accepts port 0, "any free port": a task's entry in a cluster spec may say that (see
    `ClusterSpec`); an address something connects to (a store, a rendezvous) may not.
    """
    at = f" ({where})" if where else ""
    if not isinstance(address, str) or ":" not in address:
        raise ClusterSpecError(f"bad address {address!r}{at}: expected 'host:port', e.g. 'localhost:2222'")
    host, _, port = address.rpartition(":")
    if not host:
        raise ClusterSpecError(f"bad address {address!r}{at}: the host is empty; expected 'host:port'")
    lowest = 0 if any_port else 1
    if not port.isdigit() or not lowest <= int(port) <= 65535:
        zero = " (port 0, any free port, is only for a task's own entry in a cluster spec)" if port == "0" else ""
        raise ClusterSpecError(f"bad port {port!r} in address {address!r}{at}: expected an integer in {lowest}..65535{zero}")
    return host.strip("[]") if host.startswith("[") else host, int(port)


def _check_free_ports(entries: List[Tuple[str, str]]) -> None:
    """Port 0 ("any free port", as in TF's 'localhost:0') only in a cluster of one task.

    The system tells the port it picked only to the process that bound it, and the tasks of a
    larger cluster find one another at the addresses in the spec, so theirs must be known before
    any task starts. TF accepts such a spec and its tasks wait forever for a peer at port 0;
    towerflow refuses it here, naming the entries.
    """
    zero = [(where, address) for where, address in entries if split_address(address, where, any_port=True)[1] == 0]
    if zero and len(entries) > 1:
        named = ", ".join(f"{where} ({address!r})" for where, address in zero)
        raise ClusterSpecError(
            f"port 0 in {named}: port 0 means 'any free port', which only a cluster of one task can use. This "
            f"cluster has {len(entries)} tasks, and each finds the others at the addresses in the spec, so every "
            "port must be known before the tasks start (the port the system picks is known only to the task that "
            "bound it). Give each task a fixed port, e.g. 'localhost:2222', or let `towerflow launch --ps N "
            "--workers M SCRIPT` pick free ports for a cluster on this machine."
        )


def canonical_host(host: str) -> str:
    """The host as towerflow compares hosts: lower case, this machine's names as 127.0.0.1."""
    return _LOCAL_NAMES.get(host.lower(), host.lower())




def _ordered_jobs(jobs: Iterable[str]) -> List[str]:
    jobs = list(jobs)
    known = [j for j in JOB_ORDER if j in jobs]
    return known + sorted(j for j in jobs if j not in JOB_ORDER)


class ClusterSpec:
    """The jobs of a cluster and the `host:port` of each task, validated on construction.

    As in TensorFlow, `ClusterSpec({})` is an empty (falsy) spec, a job may have no tasks, and a
    job given as `{index: address}` may skip indices (`task_indices`, `task_address` by index);
    only forming a process group (`rank_of`, `replicas`) needs every index 0..n-1.

    Port 0 ('localhost:0') means "any free port", as in TF, in a cluster of one task: its Server
    binds a free port and reports it (`Server.address`, `Server.target`). A cluster of several
    tasks with port 0 is refused here, since its tasks could not find each other.
    """

    def __init__(self, cluster: ClusterLike):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        if not isinstance(cluster, Mapping):
            raise ClusterSpecError(
                f"a cluster is a dict of job name -> list of 'host:port', got {type(cluster).__name__} {cluster!r}"
            )
        jobs: Dict[str, Dict[int, str]] = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str) or not JOB_NAME_PATTERN.match(job):
                raise ClusterSpecError(
                    f"bad job name {job!r}: expected a letter followed by letters, digits, '_' or '-'"
                )
            jobs[job] = self._task_list(job, tasks)
        self._jobs = {job: jobs[job] for job in _ordered_jobs(jobs)}
        _check_free_ports([(f"/job:{job}/task:{i}", address) for job, i, address in self._iter()])
        seen: Dict[Tuple[str, int], Tuple[str, str]] = {}
        for job, i, address in self._iter():
            where = f"/job:{job}/task:{i}"
            host, port = split_address(address, where, any_port=True)
            key = (canonical_host(host), port)
            if key in seen:
                first, first_address = seen[key]
                same = f"address {address!r}" if first_address == address else f"addresses {first_address!r} and {address!r} (the same place)"
                raise ClusterSpecError(
                    f"duplicate address: {same} given to both {first} and {where}; every task needs its own host:port"
                )
            seen[key] = (where, address)

    @staticmethod
    def _task_list(job: str, tasks) -> Dict[int, str]:
        """A job's tasks as {index: address}: a list, a 'a,b' string, or TF's sparse {index: address}."""
        if isinstance(tasks, str):
            tasks = [t for t in tasks.split(",") if t.strip()]
        if isinstance(tasks, (list, tuple)):
            tasks = dict(enumerate(tasks))
        if not isinstance(tasks, Mapping):
            raise ClusterSpecError(f"job {job!r}: expected a list of 'host:port', got {type(tasks).__name__} {tasks!r}")
        indexed: Dict[int, str] = {}
        for index, address in tasks.items():
            i = int(index) if isinstance(index, str) and index.isdigit() else index  # JSON keys are strings
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ClusterSpecError(f"job {job!r}: bad task index {index!r}; expected a non-negative integer")
            indexed[i] = address.strip() if isinstance(address, str) else address
        return dict(sorted(indexed.items()))

    def _iter(self):
        for job, tasks in self._jobs.items():
            for i, address in tasks.items():
                yield job, i, address

    def gaps(self, job_name: str) -> List[int]:
        """The task indices below the job's highest that it lacks ([] for a dense job)."""
        indices = self.task_indices(job_name)
        return sorted(set(range(indices[-1] + 1)) - set(indices)) if indices else []

    def check_dense(self, jobs: Iterable[str], why: str) -> None:
        """Refuse sparse task indices where a process group must be formed; the error names the gaps."""
        sparse = {job: self.gaps(job) for job in jobs if job in self._jobs and self.gaps(job)}
        if sparse:
            named = "; ".join(f"job {j!r} has tasks {self.task_indices(j)}, missing {g}" for j, g in sparse.items())
            raise ClusterSpecError(f"{why} needs every task index 0..n-1 of each job: {named}. Give the missing "
                                   "tasks or renumber them")

    # --- construction from the formats people use -------------------------------------------

    @classmethod
    def from_json(cls, path: str) -> "ClusterSpec":
        """A JSON file holding the cluster dict, or a whole TF_CONFIG (its "cluster" part is used)."""
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise ClusterSpecError(f"cannot read cluster file {path!r}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ClusterSpecError(f"cluster file {path!r} is not valid JSON: {e}") from None
        if isinstance(data, dict) and isinstance(data.get("cluster"), dict):
            data = data["cluster"]
        return cls(data)

    @classmethod
    def from_flags(cls, argv: Optional[Sequence[str]] = None) -> "ClusterSpec":
        """The seeds' flags: `--ps_hosts a:1,b:2 --worker_hosts c:3 [--chief_hosts d:4]` (rest ignored)."""
        spec, _, _ = parse_flags(argv)
        if spec is None:
            raise ClusterSpecError("no --ps_hosts / --worker_hosts / --chief_hosts flags found")
        return spec

    @classmethod
    def from_tf_config(cls, tf_config: Optional[str] = None) -> "ClusterSpec":
        """The "cluster" part of TF_CONFIG (the environment variable when no text is given)."""
        if tf_config is None:
            return cls(_taskenv.from_environment().identity.cluster or parse_tf_config("")[0])
        if not tf_config.strip():
            parse_tf_config(tf_config)  # raises: "TF_CONFIG is empty"
        return cls(_taskenv.parse_tf_config(tf_config, required=False)[0])  # '{}' or no "cluster": empty, as in TF

    @classmethod
    def from_torchrun(cls, env: Union[None, "_taskenv.TaskContext", Mapping[str, str]] = None) -> "ClusterSpec":
        """A worker-only cluster from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (a TaskContext, a mapping, or this process's).

        torchrun does not say where the other ranks live, so worker i is named
        MASTER_ADDR:MASTER_PORT+1+i; only worker 0's address is listened on (it coordinates),
        the other workers do not hold their named address when it is not on their host.
        """
        if not isinstance(env, _taskenv.TaskContext):
            env = _taskenv.from_environment() if env is None else _taskenv.read(env)
        missing = [name for name, value in (("WORLD_SIZE", env.identity.world_size), ("MASTER_ADDR", env.identity.master_addr),
                                            ("MASTER_PORT", env.identity.master_port)) if value is None]
        if missing:
            raise ClusterSpecError(f"torchrun variables missing: {', '.join(missing)} (set by torchrun for each rank)")
        size, port = env.identity.world_size, env.identity.master_port
        if port + size + 1 > 65535:
            raise ClusterSpecError(f"bad MASTER_PORT {port!r}: expected an integer port with room for {size} more above it")
        return cls({"worker": [f"{env.identity.master_addr}:{port + 1 + i}" for i in range(size)]})

    # --- TF's methods ------------------------------------------------------------------------

    @property
    def jobs(self) -> List[str]:
        """Job names, chief first, as TF lists them."""
        return list(self._jobs)

    def _check_job(self, job: str) -> List[str]:
        if job not in self._jobs:
            raise ClusterSpecError(
                f"unknown job name {job!r}; this cluster has "
                f"{'jobs ' + ', '.join(map(repr, self._jobs)) if self._jobs else 'no jobs'}."
                f"{did_you_mean(str(job), self._jobs)}"
            )
        return self._jobs[job]

    def num_tasks(self, job_name: str) -> int:
        return len(self._check_job(job_name))

    def task_indices(self, job_name: str) -> List[int]:
        return list(self._check_job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        tasks = self._check_job(job_name)
        if isinstance(task_index, bool) or not isinstance(task_index, int) or task_index not in tasks:
            n = len(tasks)
            has = (f"{n} task{'s' if n != 1 else ''} (0..{n - 1})" if not self.gaps(job_name) and n
                   else f"tasks {list(tasks)}" if n else "no tasks")
            what = "out of range" if not self.gaps(job_name) else "not a task"
            raise ClusterSpecError(f"task index {task_index!r} is {what} for job {job_name!r}, which has {has}")
        return tasks[task_index]

    def job_tasks(self, job_name: str) -> List[Optional[str]]:
        """The job's addresses by index, as TF gives them: None where a sparse job lacks an index."""
        tasks = self._check_job(job_name)
        return [tasks.get(i) for i in range(max(tasks) + 1)] if tasks else []

    def as_dict(self) -> Dict[str, Union[List[str], Dict[int, str]]]:
        """As TF: a job's list of addresses, or {index: address} for a sparse job."""
        return {job: (dict(tasks) if self.gaps(job) else list(tasks.values())) for job, tasks in self._jobs.items()}

    # --- towerflow's additions ---------------------------------------------------------------

    def tasks(self) -> List[DeviceSpec]:
        """Every task as `/job:x/replica:0/task:i`, in rank order (chief, workers, ps, others)."""
        return [DeviceSpec(job=job, replica=0, task=i) for job, i, _ in self._iter()]

    def addresses(self) -> List[str]:
        """Every task's address, in rank order (a sparse job's gaps have none)."""
        return [address for _, _, address in self._iter()]

    def threads_per_local_task(self, cores: int) -> int:
        """`cores` split among the tasks whose address is this host (every task runs all of them otherwise:
        three tasks x all cores thrash on a laptop)."""
        local = [a for a in self.addresses() if canonical_host(split_address(a, any_port=True)[0]) == "127.0.0.1"]
        return max(1, cores // max(1, len(local)))

    def rank_of(self, job_name: str, task_index: int) -> int:
        """This task's rank among all tasks, which needs every job dense."""
        self.task_address(job_name, task_index)
        self.check_dense(self._jobs, "forming the cluster's process group")
        return [(t.job, t.task) for t in self.tasks()].index((job_name, task_index))

    def replicas(self) -> List[DeviceSpec]:
        """The training replicas: chief (or master) then workers; their order is the process-group rank."""
        self.check_dense(REPLICA_JOBS, "the replicas' process group")
        return [t for t in self.tasks() if t.job in REPLICA_JOBS]

    def coordinator(self) -> DeviceSpec:
        """The task that hosts the rendezvous store: the first in rank order."""
        tasks = self.tasks()
        if not tasks:
            raise ClusterSpecError(f"the cluster {self} has no tasks, so no task can coordinate it")
        return tasks[0]

    def fingerprint(self) -> str:
        """A short hash that is equal for equal specs; tasks compare it when they join."""
        canon = json.dumps({j: {i: _normal(a) for i, a in t.items()} for j, t in self._jobs.items()}, sort_keys=True)
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self.fingerprint() == other.fingerprint()

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __str__(self) -> str:
        """As TF prints it: jobs sorted by name."""
        jobs = self.as_dict()
        return "ClusterSpec({" + ", ".join(f"{job!r}: {jobs[job]!r}" for job in sorted(jobs)) + "})"

    __repr__ = __str__


def _normal(address: str) -> str:
    host, port = split_address(address, any_port=True)
    return f"{canonical_host(host)}:{port}"


def parse_tf_config(text: str) -> Tuple[Dict, Optional[str], Optional[int]]:
    """TF_CONFIG text -> (cluster dict, task type, task index); the one parser is `taskenv.parse_tf_config`."""
    return _taskenv.parse_tf_config(text)


def cluster_flags() -> argparse.ArgumentParser:
    """The seeds' cluster flags (`--ps_hosts`, `--worker_hosts`, `--chief_hosts`, `--job_name`, `--task_index`)
    as an argparse parent: `ArgumentParser(parents=[towerflow.cluster_flags()])` accepts them by name (the
    Server reads them from sys.argv) and still refuses every flag it does not know."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    g = p.add_argument_group("cluster (TensorFlow's flags; read by towerflow.Server)")
    for name in ("ps_hosts", "worker_hosts", "chief_hosts", "job_name", "task_index"):
        g.add_argument(f"--{name}", f"-{name}", f"--{name.replace('_', '-')}", dest=name, metavar=name.upper(),
                       help=argparse.SUPPRESS if name == "chief_hosts" else None)
    return p


def parse_flags(argv: Optional[Sequence[str]] = None) -> Tuple[Optional[ClusterSpec], Optional[str], Optional[int]]:
    """The seeds' flags in argv -> (spec or None, job_name or None, task_index or None); others ignored."""
    import sys

    args, _ = cluster_flags().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    cluster = {}
    for job in ("chief", "ps", "worker"):
        hosts = getattr(args, f"{job}_hosts")
        if hosts is not None:
            cluster[job] = [h for h in hosts.split(",") if h.strip()]
    index = args.task_index
    if index is not None:
        if not str(index).isdigit():
            raise ClusterSpecError(f"bad --task_index {index!r}: expected a non-negative integer")
        index = int(index)
    return (ClusterSpec(cluster) if cluster else None), args.job_name, index
