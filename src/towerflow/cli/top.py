"""`towerflow top LOGDIR [--watch S | --once]`: a live per-task view of a job from its metrics file."""

from __future__ import annotations

import os


def register(sub) -> None:
    p = sub.add_parser("top", help="live per-task view of a training job from LOGDIR/metrics.jsonl")
    p.add_argument("logdir")
    p.add_argument("--watch", type=float, default=2.0, metavar="SECONDS", help="refresh interval (default 2)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=run)


def run(args) -> int:
    from towerflow import _files
    from towerflow.monitoring.top import run as top

    path = os.path.join(args.logdir, _files.METRICS_FILE)
    if not os.path.exists(path):
        print(f"towerflow top: no {path}; start a job with --logdir {args.logdir} (it writes {_files.METRICS_FILE} there)")
        return 2
    if args.watch <= 0:
        print(f"towerflow top: --watch {args.watch}: expected a positive number of seconds")
        return 2
    return top(args.logdir, watch=None if args.once else args.watch)
