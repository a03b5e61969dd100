"""`towerflow cluster [--json] [--scheduler NAME] [--ps N] [--chief] [--evaluator]`: what the scheduler says, starting nothing."""

from __future__ import annotations

import dataclasses
import json
import sys


def register(sub) -> None:
    p = sub.add_parser("cluster", help="print the cluster and task the scheduler's environment resolves to")
    p.add_argument("--json", action="store_true", help="print TF_CONFIG's shape plus what was detected as one line of JSON "
                   "(the ranks of an srun / mpirun / torchrun sharing one output print a line each)")
    p.add_argument("--scheduler", default=None, metavar="NAME",
                   help="use this resolver instead of detecting one (tf_config, skypilot, kubernetes, torchrun, mpi, lsf, slurm, env; "
                        "default: $TOWERFLOW_SCHEDULER, else detected)")
    p.add_argument("--ps", type=_count, default=None, metavar="N", help="how many ranks are ps tasks (default: $TOWERFLOW_PS_TASKS, else 0)")
    p.add_argument("--chief", action="store_const", const=True, default=None, help="the first rank is the chief ($TOWERFLOW_CHIEF)")
    p.add_argument("--evaluator", action="store_const", const=True, default=None, help="one rank is the evaluator ($TOWERFLOW_EVALUATOR)")
    p.set_defaults(func=run)


def _count(text: str) -> int:
    import argparse

    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def run(args) -> int:
    from towerflow import taskenv
    from towerflow.cluster.schedulers import Roles, resolve
    from towerflow.errors import TowerflowError

    try:
        env = taskenv.from_environment().scheduler_env
        roles = Roles.from_env(env)
        given = {k: v for k, v in (("ps", args.ps), ("chief", args.chief), ("evaluator", args.evaluator)) if v is not None}
        resolved = resolve(env, scheduler=args.scheduler, roles=dataclasses.replace(roles, **given))
    except TowerflowError as e:
        print(f"towerflow cluster: error: {e}", file=sys.stderr)
        return 2
    if resolved is None:
        if args.json:
            print(json.dumps({"scheduler": None, "cluster": {}, "task": None}), flush=True)
        else:
            print("not distributed: no scheduler's variables (Slurm, MPI, Kubernetes, torchrun, env:// RANK/WORLD_SIZE) "
                  "and no TF_CONFIG cluster")
        return 0
    print(json.dumps(resolved.as_json()) if args.json else _text(resolved), flush=True)
    return 0


def _text(r) -> str:
    place = ", ".join(s for s in (
        f"rank {r.rank} of {r.world_size}" if r.rank is not None else "",
        f"local rank {r.local_rank} of {r.local_world_size}" if r.local_rank is not None and r.local_world_size else "",
        f"device {r.device}" if r.device else "",
        f"restart {r.restart_count}" if r.restart_count else "",
    ) if s)
    lines = [f"scheduler: {r.scheduler}", f"task:      /job:{r.job_name}/task:{r.task_index}" + (f" ({place})" if place else "")]
    if r.cluster is not None:
        from towerflow.cluster.spec import ClusterSpec

        lines += [f"address:   {r.address or '(not in the cluster)'}", f"cluster:   {ClusterSpec(r.cluster)}"]
    else:
        jobs = ", ".join(f"{job} x {n}" for job, n in r.jobs.items())
        lines += [f"address:   port {r.port} on this host" if r.port else "address:   (gathered at runtime)",
                  f"cluster:   {jobs}; the addresses are gathered at runtime through the rendezvous at {r.rendezvous}"]
    lines.append("from:      " + " ".join(f"{k}={v}" for k, v in r.source.items()))
    return "\n".join(lines)
