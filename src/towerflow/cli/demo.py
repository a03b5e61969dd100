"""`towerflow demo`: the whole system in under a minute — an embedded cluster (1 ps + 2 workers,
async parameter servers) training on scikit-learn's digits; `--placement` runs the placement tour."""

from __future__ import annotations

import os
import time


def register(sub) -> None:
    p = sub.add_parser("demo", help="train on an embedded local cluster (1 ps + 2 workers) and show what happened")
    p.add_argument("--steps", type=int, default=1500, help="global training steps (default 1500)")
    p.add_argument("--logdir", default=None, help="where checkpoints, metrics and plots go (default runs/demo-<time>)")
    p.add_argument("--placement", action="store_true", help="run the device-placement tour instead")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.placement:
        from towerflow.demos.placement import main

        return main()
    from towerflow.cli import main as towerflow_main
    from towerflow.demos import cluster_digits

    logdir = args.logdir or os.path.join("runs", time.strftime("demo-%Y%m%d-%H%M%S"))
    print(f"towerflow demo: 1 ps + 2 workers on this machine, async parameter servers, logdir {logdir}", flush=True)
    return towerflow_main(
        ["launch", "--ps", "1", "--workers", "2", "--logdir", logdir, cluster_digits.__file__, "--steps", str(args.steps)]
    )
