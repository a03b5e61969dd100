"""`towerflow demo`: the whole system in under a minute — an embedded cluster (1 ps + 2 workers,
async parameter servers) training on scikit-learn's digits; `--placement` runs the placement tour.

Once every task has ended it draws the report and closes with one line per artefact: its path
relative to the current folder and the command that shows it."""

from __future__ import annotations

import glob
import os
import time
from typing import List, Optional, Sequence, Tuple


def register(sub) -> None:
    p = sub.add_parser("demo", help="train on an embedded local cluster (1 ps + 2 workers) and show what happened")
    p.add_argument("--steps", type=int, default=1500, help="global training steps (default 1500)")
    p.add_argument("--logdir", default=None, help="where checkpoints, metrics and plots go (default runs/demo-<time>)")
    p.add_argument("--placement", action="store_true", help="run the device-placement tour instead")
    p.set_defaults(func=run)


def _short(path: str, cwd: Optional[str] = None) -> str:
    """`path` relative to the current folder when it is below it, else as given."""
    rel = os.path.relpath(os.path.abspath(path), cwd or os.getcwd())
    return path if rel.startswith("..") else rel


def artefacts(logdir: str, report_files: Sequence[str]) -> List[Tuple[str, str, str]]:
    """(what, path, command to view it) for what a finished demo left in `logdir`."""
    from towerflow import _files
    from towerflow.monitoring.tensorboard import TENSORBOARD_DIR

    manifests = sorted(glob.glob(os.path.join(logdir, _files.CHECKPOINT_GLOB)))
    out = []
    if manifests:
        out.append(("checkpoint", manifests[-1][: -len(".json")] + ".pt", ""))
    out.append(("metrics", os.path.join(logdir, _files.METRICS_FILE), f"towerflow top {logdir}"))
    by_name = {os.path.basename(p): p for p in report_files}
    if "report.md" in by_name:
        out.append(("report", by_name["report.md"], f"towerflow report {logdir}"))
    if "dashboard.png" in by_name:
        out.append(("dashboard", by_name["dashboard.png"], "open it in an image viewer"))
    tb = os.path.join(logdir, TENSORBOARD_DIR)
    if os.path.isdir(tb):
        out.append(("tensorboard", tb, f"tensorboard --logdir {tb}"))
    return out


def closing_lines(items: Sequence[Tuple[str, str, str]], cwd: Optional[str] = None) -> List[str]:
    """One line per artefact: what, short path, and the command to view it, in aligned columns."""
    rows = [(what, _short(path, cwd), cmd) for what, path, cmd in items]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return [f"  {what:<{w0}}  {path:<{w1}}  {cmd}".rstrip() for what, path, cmd in rows]


def run(args) -> int:
    if args.placement:
        from towerflow.demos.placement import main

        return main()
    from towerflow.cli import main as towerflow_main
    from towerflow.demos import cluster_digits
    from towerflow.monitoring.report import write_report

    logdir = args.logdir or os.path.join("runs", time.strftime("demo-%Y%m%d-%H%M%S"))
    print(f"towerflow demo: 1 ps + 2 workers on this machine, async parameter servers, logdir {logdir}", flush=True)
    code = towerflow_main(
        ["launch", "--ps", "1", "--workers", "2", "--logdir", logdir, cluster_digits.__file__, "--steps", str(args.steps)]
    )
    try:
        written = write_report(logdir)
    except (OSError, ValueError) as e:
        print(f"towerflow demo: no report: {e}")
        written = []
    print(f"\nwhat the demo left in {_short(logdir)}/ (and how to look at it):")
    print("\n".join(closing_lines(artefacts(logdir, written))), flush=True)
    return code
