"""`towerflow launch`: run a script as every task of a local cluster, or as one task of a multi-host one.

    towerflow launch --ps 1 --workers 2 [--chief] SCRIPT [ARGS...]      # the whole cluster, loopback
    towerflow launch --cluster cluster.json --job_name worker --task_index 1 SCRIPT [ARGS...]
    towerflow launch --devices gpu:0,gpu:1 SCRIPT                        # one worker per device
    towerflow launch --nproc 4 SCRIPT                                    # four CPU workers
    towerflow launch --ps 1 --workers 3 --mode sync --replicas-to-aggregate 2 SCRIPT   # one backup worker
    srun -n 3 towerflow launch --ps 1 SCRIPT          # under a scheduler: this slot's task of its job
    mpirun -n 3 towerflow launch --ps 1 SCRIPT        # (Slurm, Open MPI, a TFJob/PyTorchJob pod)

Under a scheduler (detected, or --scheduler NAME / TOWERFLOW_SCHEDULER) each process the scheduler
starts runs its own task of the job: --ps N, --chief and --evaluator say which ranks take those
roles (TOWERFLOW_PS_TASKS, TOWERFLOW_CHIEF, TOWERFLOW_EVALUATOR otherwise), the rest are workers;
the scheduler says how many tasks there are, so --workers/--nproc/--devices are refused there.
`--scheduler none` ignores the scheduler (an embedded cluster in every slot).

The ps tasks run `python -m towerflow.ps.serve` (they serve variables until every task is done),
the chief and workers the script; `--ps-runs-script` runs the script on ps tasks too.
Each task's output is prefixed with its name; if a task fails the rest are stopped, the launcher
names the task whose own code failed first (its traceback once, a line for each task that stopped
because of it; docs/fault-tolerance.md) and exits with that task's code. Every flag has both spellings (`--task-index` and
`--task_index`) and falls back to an environment variable. Tasks of a cluster with ps tasks get
THP_MEM_ALLOC_ENABLE=1, MALLOC_MMAP_MAX_=0, MALLOC_ARENA_MAX=1 and MALLOC_TRIM_THRESHOLD_=2147483647
(allocator settings for the messaging layer's receive buffers, docs/parameter-server.md), each
unless the environment sets it.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # the command line imports what a launch needs only when it runs one
    from towerflow.launch.config import LaunchConfig


def _env(name: str, default=None):
    from towerflow.launch.environment import launch_default

    return launch_default(name, default)


def _int_env(name: str, default=None):
    from towerflow.launch.environment import launch_default_int

    return launch_default_int(name, default)


def register(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="start a cluster's tasks (or one task of a multi-host cluster) running a script",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    local = p.add_argument_group("embedded cluster on this machine")
    local.add_argument("--ps", type=int, default=_int_env("TOWERFLOW_LAUNCH_PS", 0), metavar="N", help="parameter-server tasks (default 0)")
    local.add_argument("--workers", type=int, default=_int_env("TOWERFLOW_LAUNCH_WORKERS"), metavar="N", help="worker tasks (default 1)")
    local.add_argument("--chief", action="store_true", help="add a chief task (it coordinates; otherwise worker 0 does)")
    local.add_argument("--devices", default=_env("TOWERFLOW_LAUNCH_DEVICES"), metavar="LIST", help="one worker per device, e.g. gpu:0,gpu:1 (sets TOWERFLOW_DEVICE)")
    local.add_argument("--evaluator", action="store_true", help="under a scheduler: one rank is the evaluator")
    local.add_argument("--scheduler", default=None, metavar="NAME",
                       help="the scheduler whose slot this is (slurm, mpi, kubernetes, torchrun, env, tf_config) "
                            "instead of detecting one; 'none' ignores a scheduler (default: TOWERFLOW_SCHEDULER, else detected)")
    local.add_argument("--nproc", type=int, default=_int_env("TOWERFLOW_LAUNCH_NPROC"), metavar="N", help="N workers on the CPU")
    one = p.add_argument_group("one task of a multi-host cluster")
    one.add_argument("--cluster", default=_env("TOWERFLOW_CLUSTER_FILE"), metavar="FILE", help="cluster JSON file ({job: [host:port, ...]} or a TF_CONFIG)")
    one.add_argument("--job_name", "--job-name", dest="job_name", default=_env("TOWERFLOW_JOB_NAME"), metavar="J", help="this task's job")
    one.add_argument("--task_index", "--task-index", dest="task_index", type=int, default=_int_env("TOWERFLOW_TASK_INDEX"), metavar="I", help="this task's index in its job")
    one.add_argument("--master_port", "--master-port", dest="master_port", type=int, default=None, metavar="PORT", help="port of the replicas' process group (default: first replica's port + 10000)")
    p.add_argument("--max_restarts", "--max-restarts", dest="max_restarts", type=int, default=_int_env("TOWERFLOW_MAX_RESTARTS", 0), metavar="N", help="restart a failed task up to N times (default 0); without ps tasks (all-reduce) a failure restarts every task")
    p.add_argument("--logdir", default=_env("TOWERFLOW_LOGDIR"), metavar="DIR", help="handed to every task as TOWERFLOW_LOGDIR")
    p.add_argument("--store", default=_env("TOWERFLOW_LAUNCH_STORE"), metavar="URL",
                   help="keep the cluster's rendezvous in etcd, which outlives any task and host: "
                        "etcd://HOST:PORT[,HOST:PORT...][/PREFIX] (default: the launcher's or the coordinator's own store)")
    ps = p.add_argument_group("parameter-server update mode (handed to every task)")
    ps.add_argument("--mode", choices=("async", "sync", "ssp"), default=None, help="how the ps tasks apply pushed gradients")
    ps.add_argument("--replicas_to_aggregate", "--replicas-to-aggregate", dest="replicas_to_aggregate", type=int, default=None, metavar="N", help="sync: gradients per update (fewer than the workers = backup workers)")
    ps.add_argument("--staleness", type=int, default=None, metavar="K", help="ssp: how many steps a worker may run ahead of the slowest")
    ps.add_argument("--local_steps", "--local-steps", dest="local_steps", type=_local_steps, default=None, metavar="K",
                    help="geo / local SGD: each worker takes K steps of its own optimizer, then pushes its parameter "
                         "delta (default 1: push gradients every step)")
    ps.add_argument("--dense", choices=("ps", "allreduce"), default=None,
                    help="where the dense layers train: 'ps' (default: every parameter on the ps tasks) or 'allreduce' "
                         "(hybrid: only the embedding tables on the ps tasks, the rest replicated on the workers and "
                         "all-reduced every step; a lost worker restarts every worker, the ps tasks go on)")
    ps.add_argument("--ps_replicas", "--ps-replicas", dest="ps_replicas", type=int, default=None, metavar="N",
                    help="copies of each ps task's part: 1 (default) or 2 (a mirror on another ps task, on another host "
                         "where there is one, kept in step "
                         "before each reply, so a lost ps task loses no acknowledged update; needs --ps 2 or more)")
    ps.add_argument("--ps_replica_lag", "--ps-replica-lag", dest="ps_replica_lag", type=int, default=None, metavar="N",
                    help="with --ps-replicas 2 and --mode async: replies may run up to N ops ahead of the backup "
                         "(default 0: each waits for it); a lost ps task then loses at most N acknowledged pushes, "
                         "reported")
    ps.add_argument("--publish_every", "--publish-every", dest="publish_every", type=float, default=None,
                    metavar="SECONDS", help="every ps task publishes its table rows changed since its last publication "
                    "(a numbered Parquet delta, after a full snapshot first) every SECONDS, while training runs "
                    "(docs/serving.md)")
    ps.add_argument("--publish_to", "--publish-to", dest="publish_to", default=None, metavar="DIR",
                    help="with --publish-every: the folder the publications go to (default: LOGDIR/publish), or "
                         "redis://HOST:PORT/DB")
    ps.add_argument("--snapshot_every", "--snapshot-every", dest="snapshot_every", type=_snapshot_every, default=None,
                    metavar="auto|K", help="with --publish-every and a folder: when a ps task writes another full "
                    "snapshot: 'auto' (default) once the deltas since its last one hold as many rows as a snapshot, "
                    "or after every K deltas")
    p.add_argument("--profile_steps", "--profile-steps", dest="profile_steps", type=_profile_steps, default=None,
                   metavar="START[:COUNT]",
                   help="profile COUNT (default 10) of each task's training steps from global step START with "
                        "torch.profiler: a trace and a table of the ops per task in LOGDIR/profile (needs --logdir)")
    p.add_argument("--ps_runs_script", "--ps-runs-script", dest="ps_runs_script", action="store_true",
                   help="ps tasks run the script too (for scripts that put work of their own on ps tasks); by default "
                        "they run `python -m towerflow.ps.serve`, which serves variables until every task is done")
    p.add_argument("script", help="the Python script (or program) the chief and workers run (ps tasks serve)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def _local_steps(text: str) -> int:
    """--local-steps K: a whole number >= 1 (argparse prints the message with the flag's name)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a whole number of local steps K >= 1 (1 pushes gradients every step, as without the "
            "flag; K > 1 pushes each worker's parameter delta every K steps), e.g. --local-steps 4"
        )
    return value


def _snapshot_every(text: str) -> Optional[int]:
    """--snapshot-every auto|K: None (by volume) or a whole number of deltas >= 1."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected 'auto' (a snapshot once the deltas since the last one hold as many rows as a "
            "snapshot) or a whole number of deltas K >= 1, e.g. --snapshot-every 10")
    return value


def _profile_steps(text: str) -> tuple:
    """--profile-steps START[:COUNT]: a global step >= 0 and a number of steps >= 1 (10 when left out)."""
    start, _, count = text.partition(":")
    try:
        window = (int(start), int(count) if count else 10)
    except ValueError:
        window = (-1, 0)
    if window[0] < 0 or window[1] < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected START or START:COUNT, a global step >= 0 and a number of steps >= 1, e.g. "
            "--profile-steps 100 (10 steps of each task from global step 100) or --profile-steps 100:5")
    return window


def config_of(args) -> LaunchConfig:
    """The parsed flags as the `LaunchConfig` that planning reads."""
    from towerflow.launch.config import LaunchConfig


    return LaunchConfig(
        script=args.script, script_args=tuple(args.args), ps=args.ps, workers=args.workers, chief=args.chief,
        devices=args.devices, nproc=args.nproc, evaluator=args.evaluator, scheduler=args.scheduler,
        cluster_file=args.cluster, job_name=args.job_name, task_index=args.task_index, master_port=args.master_port,
        max_restarts=args.max_restarts, logdir=args.logdir, store=args.store, ps_runs_script=args.ps_runs_script, mode=args.mode,
        replicas_to_aggregate=args.replicas_to_aggregate, staleness=args.staleness, local_steps=args.local_steps,
        ps_replicas=args.ps_replicas, ps_replica_lag=args.ps_replica_lag, profile=args.profile_steps, dense=args.dense,
        publish_every=args.publish_every, publish_to=args.publish_to, snapshot_every=args.snapshot_every,
    )


def run(args) -> int:
    from towerflow import _log
    from towerflow.errors import TowerflowError
    from towerflow.launch import planning

    config = config_of(args)
    _log.configure("launcher")  # what the library says in this process names it
    try:
        plan = planning.plan_launch(config)
        return planning.run(config, plan)
    except TowerflowError as e:  # a launch that cannot run, or a store that could not be hosted
        print(f"towerflow launch: {e}", file=sys.stderr)
        return 2
