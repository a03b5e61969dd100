"""The embedded local cluster: every task of a cluster on this machine, on loopback, with free ports.

`plan_local()` decides the cluster and each task's environment, and holds its ports (the launcher hosts the
cluster's rendezvous store itself, so a killed chief can come back); `plan_one()` does the same
for one task of a multi-host cluster (`--cluster FILE --job_name J --task_index I`). Both
hand their plans to the Supervisor, so one script works under either.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
from typing import List, Optional, Sequence

from towerflow.cluster import addresses as _addresses
from towerflow.cluster.ports import LOOPBACK, PortReservation
from towerflow.cluster.spec import ClusterSpec, split_address
from towerflow.devices.spec import DeviceSpec
from towerflow.errors import DeviceSpecError, LaunchError
from towerflow.launch import environment as _env
from towerflow.launch.task_process import TaskProcessSpec

MASTER_PORT_OFFSET = 10000  # multi-host: the replicas' process group meets at the first replica's port + this
PS_SERVE_MODULE = "towerflow.ps.serve"  # named, not imported: the launcher sits below `ps`


@dataclasses.dataclass
class LaunchPlan:
    """The cluster a launch runs and the processes of this machine."""

    cluster: ClusterSpec
    tasks: List[TaskProcessSpec]
    store_address: Optional[str] = None  # the launcher hosts the rendezvous store here (local clusters without --store)
    token: Optional[str] = None
    restart_scope: str = "task"  # "group" for all-reduce replicas: one lost replica restarts them all
    ports: Optional[PortReservation] = None  # a local cluster's ports, held until the launch ends (cluster/ports.py)

    def release(self) -> None:
        if self.ports is not None:
            self.ports.release()


def command_for(script: str, args: Sequence[str]) -> List[str]:
    """A .py file runs under this interpreter; anything else runs as a program."""
    if script.endswith(".py") or (os.path.isfile(script) and not os.access(script, os.X_OK)):
        if not os.path.isfile(script):
            raise LaunchError(f"script {script!r} not found (cwd {os.getcwd()!r})")
        return [sys.executable, script, *args]
    return [script, *args]


def ps_command(script_argv: Sequence[str] = ()) -> List[str]:
    """What a ps task runs: it only serves variables, so the training script runs on the chief and workers.

    The script's folder goes first on the ps's import path, as it would for `python script.py`: a
    worker may send it functions by reference to modules beside the script.
    """
    script = next((a for a in script_argv[1:2] if a.endswith(".py")), None) if script_argv else None
    where = ["--import-path", os.path.dirname(os.path.abspath(script))] if script else []
    return [sys.executable, "-m", PS_SERVE_MODULE, *where]


def argv_of(job: str, script_argv: Sequence[str], ps_argv: Optional[Sequence[str]]) -> List[str]:
    if job != "ps":
        return list(script_argv)
    return list(ps_argv) if ps_argv is not None else ps_command(script_argv)


def parse_devices(devices: str) -> List[str]:
    """'gpu:0,gpu:1' -> ['/device:GPU:0', '/device:GPU:1'] (the one device parser; errors name the item)."""
    out = []
    for item in [d.strip() for d in devices.split(",") if d.strip()]:
        try:
            spec = DeviceSpec.parse(item)
        except DeviceSpecError as e:
            raise LaunchError(f"--devices: {e}") from None
        if spec.device_type is None or spec.job is not None or spec.task is not None:
            raise LaunchError(f"--devices item {item!r} is not a local device like 'gpu:0' or 'cpu:0'")
        out.append(spec.replace(device_index=spec.device_index or 0).device_name)
    if not out:
        raise LaunchError(f"--devices {devices!r} names no device; expected e.g. 'gpu:0,gpu:1'")
    if len(set(out)) != len(out):
        raise LaunchError(f"--devices {devices!r} names a device twice")
    return out


def interface_environment(binding: _addresses.Binding) -> dict:
    """GLOO_/TP_/NCCL_SOCKET_IFNAME for a task, each unless the launching environment chose one."""
    return _env.unset(binding.socket_environment())


def plan_local(
    script_argv: List[str],
    ps: int = 0,
    workers: Optional[int] = None,
    chief: bool = False,
    devices: Optional[str] = None,
    nproc: Optional[int] = None,
    logdir: Optional[str] = None,
    token: Optional[str] = None,
    ps_argv: Optional[Sequence[str]] = None,
    store: Optional[str] = None,
) -> LaunchPlan:
    """The whole cluster on this machine: chief, workers (one per device with --devices/--nproc), ps.
    The ps tasks run `ps_argv`, by default `ps_command()` (pass the script's argv for scripts that
    put work of their own on ps tasks). `store` (etcd://...) holds the rendezvous instead of the launcher."""
    device_list: List[Optional[str]] = []
    if devices and nproc:
        raise LaunchError("--devices and --nproc both say how many workers to start; give one of them")
    if devices:
        device_list = list(parse_devices(devices))
    elif nproc:
        device_list = ["/device:CPU:0"] * nproc
    if device_list and workers is not None and workers != len(device_list):
        raise LaunchError(
            f"--workers {workers} disagrees with {len(device_list)} device(s) from --devices/--nproc; drop --workers"
        )
    n_workers = len(device_list) if device_list else (1 if workers is None else workers)
    for flag, value in (("--ps", ps), ("--workers", n_workers)):
        if value < 0:
            raise LaunchError(f"{flag} {value} must be >= 0")
    if n_workers == 0 and not chief:
        raise LaunchError("a cluster needs a chief or at least one worker: add --workers N or --chief")
    counts = {"chief": int(chief), "worker": n_workers, "ps": ps}
    reservation = PortReservation(sum(counts.values()) + 2)
    try:
        return _local_plan(counts, reservation, device_list, script_argv, ps_argv, logdir, token, store)
    except BaseException:
        reservation.release()
        raise


def _local_plan(
    counts: dict, reservation: PortReservation, device_list: List[Optional[str]], script_argv: List[str],
    ps_argv: Optional[Sequence[str]], logdir: Optional[str], token: Optional[str], store: Optional[str] = None,
) -> LaunchPlan:
    """The plan over ports already held: chief, workers, ps in order, then the store's and the replicas' port."""
    ports = list(reservation.ports)
    master_port = ports.pop()
    store_port = ports.pop()  # unused with a store in etcd
    store_address = f"{LOOPBACK}:{store_port}" if store is None else None
    cluster = ClusterSpec({job: [f"{LOOPBACK}:{ports.pop(0)}" for _ in range(n)] for job, n in counts.items() if n})
    token = token or _env.inherited_token() or secrets.token_hex(16)
    tasks = []
    here = _addresses.local_addresses()  # asked once: every task of this cluster is on this machine
    for t in cluster.tasks():
        device = device_list[t.task] if t.job == "worker" and device_list else None
        env = _env.task_environment(
            cluster, t.job, t.task, master_addr=LOOPBACK, master_port=master_port,
            logdir=logdir, device=device, token=token, store=store or store_address,
        )
        env.update(interface_environment(_addresses.binding_for(cluster, t.job, t.task, here)))
        tasks.append(TaskProcessSpec(t.job, t.task, argv_of(t.job, script_argv, ps_argv), env,
                                     serves_only=t.job == "ps" and ps_argv is None))
    # all-reduce replicas (no ps) share one process group that a lost member breaks: restart all of them
    scope = "group" if not counts["ps"] and len(tasks) > 1 else "task"
    return LaunchPlan(cluster, tasks, store_address, token, scope, reservation)


def replica_master(cluster: ClusterSpec, master_port: Optional[int] = None) -> tuple:
    """(MASTER_ADDR, MASTER_PORT) of a multi-host cluster's replicas: the first replica's host as this
    machine dials it, its port + 10000 (- 10000 past 65535) unless `master_port` is given."""
    replicas = cluster.replicas()
    first = replicas[0] if replicas else cluster.tasks()[0]
    entry = cluster.task_address(first.job, first.task)
    host, port = split_address(entry, any_port=True)
    if master_port is None and port == 0:
        raise LaunchError(
            f"the replicas' process group meets at the first replica's port + {MASTER_PORT_OFFSET}, but "
            f"/job:{first.job}/task:{first.task} is at {entry!r}: port 0 (any free port) is picked by the task "
            "only once it runs, so the launcher cannot derive the group's port from it before starting it. Pass "
            f"--master-port PORT, or give /job:{first.job}/task:{first.task} a fixed port in the cluster file."
        )
    if master_port is None:
        master_port = port + MASTER_PORT_OFFSET if port + MASTER_PORT_OFFSET <= 65535 else port - MASTER_PORT_OFFSET
    return _addresses.dial_host(cluster, host), master_port


def plan_one(
    script_argv: List[str],
    cluster_file: str,
    job_name: str,
    task_index: int,
    logdir: Optional[str] = None,
    master_port: Optional[int] = None,
    ps_argv: Optional[Sequence[str]] = None,
    store: Optional[str] = None,
) -> LaunchPlan:
    """One task of a multi-host cluster; the token comes from this host's environment, if any.
    A ps task runs `ps_argv`, as in `plan_local`; `store` (etcd://...) holds the rendezvous instead
    of the coordinator task.

    The task's entry must be an address of this machine (checked here, before anything starts);
    its interface is handed to gloo, TensorPipe and NCCL unless this environment names one.
    """
    cluster = ClusterSpec.from_json(cluster_file)
    binding = _addresses.binding_for(cluster, job_name, task_index)
    master_addr, master_port = replica_master(cluster, master_port)
    env = _env.task_environment(cluster, job_name, task_index, master_addr=master_addr, master_port=master_port,
                                logdir=logdir, store=store)
    env.update(interface_environment(binding))
    return LaunchPlan(cluster, [TaskProcessSpec(job_name, task_index, argv_of(job_name, script_argv, ps_argv), env)])
