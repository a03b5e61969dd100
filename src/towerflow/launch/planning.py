"""From a `LaunchConfig` to the processes to run: the one planning function of `towerflow launch`.

Three shapes of launch, checked in this order: a scheduler's slot (srun, mpirun, a pod: this
process runs its own task of the scheduler's job), one task of a cluster file (`--cluster`), or a
whole embedded cluster on this machine. `plan_launch` picks one, refuses flags that do not belong
to it, and returns the `LaunchPlan`; `run` supervises it to the end.
"""

from __future__ import annotations

import dataclasses
import gc
import os

from towerflow import _files, _log, etcd_url, redis_url, taskenv
from towerflow.cluster.environment import scheduled_slot
from towerflow.cluster.schedulers import Roles
from towerflow.cluster.spec import ClusterSpec, canonical_host, split_address
from towerflow.errors import LaunchError, TowerflowError
from towerflow.launch.config import LaunchConfig
from towerflow.launch.environment import export_profile, export_ps_mode, export_publish, has_token, wire_security
from towerflow.launch.local import LaunchPlan, command_for, plan_local, plan_one
from towerflow.launch.scheduled import plan_scheduled
from towerflow.launch.supervisor import Supervisor


def plan_launch(config: LaunchConfig) -> LaunchPlan:
    """The plan for `config`; TowerflowError (the flag, what is wrong, how to fix it) for a launch that cannot run."""
    argv = command_for(config.script, config.script_args)  # a missing script fails before the slots meet
    resolved = None if config.cluster_file else _scheduled_slot(config)
    pass_ps_mode(config, bool(config.ps) or (resolved is not None and "ps" in resolved.jobs))
    if config.profile is not None:
        if not config.logdir:
            raise TowerflowError(f"--profile-steps {':'.join(map(str, config.profile))} writes each task's trace and "
                                 "table under the logdir: add --logdir DIR (they go to DIR/profile)")
        export_profile(*config.profile)
    check_publish(config)
    ps_argv = argv if config.ps_runs_script else None
    logdir = os.path.abspath(config.logdir) if config.logdir else None
    store = etcd_url.parse_etcd_url(config.store, "--store").url() if config.store else None
    if resolved is not None:
        plan = plan_scheduled(argv, resolved, logdir=logdir, ps_argv=ps_argv, master_port=config.master_port,
                              store=store)
        _say_about_hosts(plan.cluster)
        return plan
    if config.evaluator:
        raise TowerflowError("--evaluator is a role among a scheduler's ranks (srun, mpirun, ...); the embedded "
                             "cluster has none: drop --evaluator")
    if config.cluster_file:
        if config.job_name is None or config.task_index is None:
            raise TowerflowError("--cluster needs --job_name and --task_index: which task of it runs here?")
        if config.ps or config.workers or config.chief or config.devices or config.nproc:
            raise TowerflowError("--cluster runs one task of a given cluster; drop --ps/--workers/--chief/--devices/--nproc")
        plan = plan_one(argv, config.cluster_file, config.job_name, config.task_index, logdir=logdir,
                        master_port=config.master_port, ps_argv=ps_argv, store=store)
        _say_about_hosts(plan.cluster)
        return plan
    plan = plan_local(argv, ps=config.ps, workers=config.workers, chief=config.chief, devices=config.devices,
                      nproc=config.nproc, logdir=logdir, ps_argv=ps_argv, store=store)
    if config.dense == "allreduce" and config.ps:  # the workers share a process group; the ps tasks are not in it
        plan.restart_scope = "replicas"
    return plan


def run(config: LaunchConfig, plan: LaunchPlan) -> int:
    """Supervise `plan`'s tasks to the end; the exit code of the launch. TowerflowError: the store could not be hosted."""
    if config.logdir:
        os.makedirs(config.logdir, exist_ok=True)
    hold = None
    if plan.store_address:  # held for the whole run: the tasks meet here, and a restarted chief finds them again
        def hold():
            from towerflow.cluster.server import host_rendezvous

            store = host_rendezvous(plan.cluster, plan.token, plan.store_address)
            gc.freeze()  # torch, imported for the store, stays out of every later collection (its exit's: ~0.5 s)
            return store

    try:  # a local cluster's ports stay held until the run ends, so a restarted task finds its port free
        return Supervisor(plan.tasks, max_restarts=config.max_restarts, restart_scope=plan.restart_scope,
                          ps_replicas=config.ps_replicas or 1).run(hold)
    finally:
        plan.release()


def pass_ps_mode(config: LaunchConfig, has_ps: bool) -> None:
    """The update-mode flags, checked (they go together, and only with parameter servers), then handed to every
    task this launch starts as the TOWERFLOW_PS_* variables the ps strategy reads."""
    if config.replicas_to_aggregate is not None and config.mode != "sync":
        raise TowerflowError(f"--replicas-to-aggregate {config.replicas_to_aggregate} goes with --mode sync (got --mode {config.mode})")
    if config.staleness is not None and config.mode != "ssp":
        raise TowerflowError(f"--staleness {config.staleness} goes with --mode ssp (got --mode {config.mode})")
    flag = config.ps_mode_flag()
    if flag is not None and not config.cluster_file and not has_ps:
        raise TowerflowError(f"{flag} chooses how parameter servers apply updates; add --ps N (N >= 1)")
    check_ps_replicas(config, has_ps)
    check_ps_replica_lag(config)
    check_dense(config, has_ps)
    export_ps_mode(config.mode, config.replicas_to_aggregate, config.staleness, config.local_steps, config.ps_replicas,
                   config.ps_replica_lag, config.dense)


def check_dense(config: LaunchConfig, has_ps: bool) -> None:
    """--dense allreduce: the tables on the ps tasks, so there must be some; every step all-reduces, so no local steps."""
    if config.dense is None:
        return
    if config.dense not in taskenv.PS_DENSE:
        raise TowerflowError(f"--dense {config.dense}: expected one of {', '.join(taskenv.PS_DENSE)}")
    if not config.cluster_file and not has_ps:
        raise TowerflowError(f"--dense {config.dense} says where parameter servers leave the dense layers; add --ps N "
                             "(N >= 1) for the embedding tables, or drop --dense to all-reduce everything")
    if config.dense == "allreduce" and config.local_steps not in (None, 1):
        raise TowerflowError(f"--dense allreduce with --local-steps {config.local_steps}: the dense layers are all-reduced "
                             "every step and the tables learn from every step's rows; drop one of them")


def check_ps_replicas(config: LaunchConfig, has_ps: bool) -> None:
    """--ps-replicas N: 1, or 2 with at least two ps tasks (each ps task's part mirrored on the next)."""
    n = config.ps_replicas
    if n is None:
        return
    if not 1 <= n <= taskenv.MAX_PS_REPLICAS or (config.ps and n > config.ps) or (not config.cluster_file and not has_ps):
        raise TowerflowError(
            f"--ps-replicas {n} with --ps {config.ps}: expected 1 (each ps task's part on it alone) or "
            f"{taskenv.MAX_PS_REPLICAS} (and a mirror on the next ps task), and no more than the ps tasks; use "
            f"--ps-replicas 2 with --ps 2 or more")


def check_publish(config: LaunchConfig) -> None:
    """--publish-every S [--publish-to DIR] [--snapshot-every K]: a positive period and a folder, handed to every
    task."""
    if config.publish_every is None:
        for flag, value in (("--publish-to", config.publish_to), ("--snapshot-every", config.snapshot_every)):
            if value is not None:
                raise TowerflowError(f"{flag} {value} says how the ps tasks publish, but nothing asks them to: add "
                                     "--publish-every SECONDS")
        return
    if not config.publish_every > 0:
        raise TowerflowError(f"--publish-every {config.publish_every:g}: expected a positive number of seconds between "
                             "publications, e.g. --publish-every 10")
    target = config.publish_to
    if target is None:
        if not config.logdir:
            raise TowerflowError("--publish-every needs a place to publish to: add --publish-to DIR, or --logdir DIR "
                                 "(the publications then go to DIR/publish)")
        target = os.path.join(config.logdir, _files.PUBLISH_SUBDIR)
    if redis_url.is_redis_url(target):
        redis_url.parse_redis_url(target)
        if config.snapshot_every is not None:
            raise TowerflowError(f"--snapshot-every {config.snapshot_every} with --publish-to {target}: Redis keeps "
                                 "each row's newest value, so only the first publication is a snapshot; drop "
                                 "--snapshot-every (it sets how often a folder of publications gets one)")
        export_publish(config.publish_every, target)
    elif "://" in target:
        raise TowerflowError(f"--publish-to {target}: expected a folder or redis://HOST:PORT/DB")
    else:
        export_publish(config.publish_every, os.path.abspath(target), config.snapshot_every)


def check_ps_replica_lag(config: LaunchConfig) -> None:
    """--ps-replica-lag N: a whole number, N > 0 only with --ps-replicas 2 and --mode async (the tasks check again)."""
    lag = config.ps_replica_lag
    if lag is None:
        return
    if lag < 0 or (lag and config.ps_replicas != 2) or (lag and (config.mode or "async") != "async"):
        raise TowerflowError(
            f"--ps-replica-lag {lag} with --ps-replicas {config.ps_replicas} --mode {config.mode or 'async'}: expected "
            "0, or N > 0 with --ps-replicas 2 and --mode async (a lost ps task may come back without up to N "
            "acknowledged pushes, which only async training can lose); drop the flag or change the others")


def _scheduled_slot(config: LaunchConfig):
    """This slot's task when a scheduler started this launcher (its cluster gathered if need be); None: no scheduler."""
    task = taskenv.from_environment()
    given = {k: v for k, v in (("ps", config.ps), ("chief", config.chief), ("evaluator", config.evaluator)) if v}
    return scheduled_slot(task, config.scheduler, dataclasses.replace(Roles.from_env(task.scheduler_env), **given),
                          check=lambda resolved: _no_task_counts(config, resolved))


def _no_task_counts(config: LaunchConfig, resolved) -> bool:
    """True, or LaunchError for --workers / --nproc / --devices under a scheduler, which starts the tasks itself."""
    extra = [f for f, v in (("--workers", config.workers), ("--nproc", config.nproc), ("--devices", config.devices))
             if v is not None]
    if extra:
        raise LaunchError(
            f"{'/'.join(extra)}: under {resolved.scheduler} the scheduler starts the tasks ({resolved.world_size} of "
            f"them), one per slot, and each replica takes the GPU of its local rank; drop {'/'.join(extra)} and ask the "
            "scheduler for more tasks (srun -n N, mpirun -n N), or add --scheduler none to run a whole embedded "
            "cluster in every slot"
        )
    return True


# What each wire security is and costs, said once by a launcher whose cluster spans hosts. The figure: docs/benchmarks.md,
# "The ps step across hosts (17M-parameter MLP)" (6.3 against 12.9 steps/s).
WIRE_SECURITY_LINES = {
    "encrypt": "wire security: CURVE (encrypted and authenticated, the default across hosts; a 17M-parameter ps step "
               "makes about half the steps/s of TOWERFLOW_WIRE_SECURITY=authenticate on 3 network-namespace hosts "
               "sharing 2 AMD EPYC cores: docs/cluster.md, \"The token\")",
    "authenticate": "wire security: PLAIN (TOWERFLOW_WIRE_SECURITY=authenticate: authenticated by the cluster token, "
                    "not encrypted; anyone on the network path can read the tensors: docs/cluster.md, \"The token\")",
}


def _say_about_hosts(cluster: ClusterSpec) -> None:
    """For a cluster on several hosts: the wire security its tasks will use, and a warning when it has no token.
    TaskEnvironmentError for a TOWERFLOW_WIRE_SECURITY the tasks would refuse."""
    hosts = {canonical_host(split_address(a, any_port=True)[0]) for a in cluster.addresses()}
    if len(hosts) < 2:  # one host (srun -n 3 on one node): its tasks authenticate, nothing to say
        return
    log = _log.get("launch", "launcher")
    log.info(WIRE_SECURITY_LINES[wire_security() or "encrypt"])
    if not has_token():
        log.warning(
            f"no cluster token ({taskenv.ENV_CLUSTER_TOKEN} or {taskenv.ENV_CLUSTER_TOKEN_FILE}) for a cluster on other "
            "hosts; any process that reaches these ports can join it and run code. Set the same token on every host "
            "(docs/cluster.md)."
        )


__all__ = ["LaunchConfig", "plan_launch", "run", "pass_ps_mode"]
