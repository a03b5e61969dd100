"""`towerflow report LOGDIR [--out DIR]`: PNG plots and a markdown summary of a job."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("report", help="plots (PNG) and a markdown summary from LOGDIR/metrics.jsonl")
    p.add_argument("logdir")
    p.add_argument("--out", default=None, help="where to write (default LOGDIR/report)")
    p.set_defaults(func=run)


def run(args) -> int:
    from towerflow.monitoring.report import write_report

    try:
        written = write_report(args.logdir, args.out)
    except (OSError, ValueError) as e:
        print(f"towerflow report: {e}")
        return 2
    for path in written:
        print(path)
    return 0
