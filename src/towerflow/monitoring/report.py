"""`towerflow report LOGDIR`: PNG plots, a dashboard and a markdown summary of a job from `metrics.jsonl`.

`panels(records)` turns the records into the plots' data (`plots.Panel`: loss against step and
against time, test accuracy where recorded, throughput per task, staleness, the ps's held and
dropped gradients, table rows); `write_report` draws each non-empty panel to its own PNG and all
of them to `dashboard.png`, and writes `report.md` with the run's summary (tasks and their
states, mode, steps, final accuracy, wall time, failures and restarts) and the images.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any, Dict, List, Optional

from towerflow import _files
from towerflow._io import atomic_write
from towerflow.monitoring.metrics import read_metrics
from towerflow.monitoring.plots import Panel, plot_curves, save_dashboard, save_panel  # noqa: F401 (plot_curves: benchmarks)
from towerflow.monitoring.runstate import LAUNCHER, run_state

DASHBOARD = "dashboard.png"
REPORT = "report.md"


def _task_records(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The tasks' own records (not the launcher's)."""
    return [r for r in records if r["task"] != LAUNCHER and r.get("role") != LAUNCHER]


def _series(records: List[Dict[str, Any]], field: str, roles=None) -> Dict[str, List[tuple]]:
    """Per task: (step, wall seconds since the job's first record, value) for records with a number in `field`."""
    start = min(r["time"] for r in records)
    series: Dict[str, List[tuple]] = defaultdict(list)
    for r in records:
        value = r.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (roles is None or r.get("role") in roles):
            series[r["task"]].append((r["step"], r["time"] - start, value))
    return dict(series)


def staleness_histogram(records: List[Dict[str, Any]]) -> Dict[int, int]:
    """All tasks' staleness histograms added up ({staleness: pushes}).

    A task's `staleness` is cumulative since it started, so its newest record counts. The ps
    tasks see every push, so with ps records only theirs count (workers would count each push twice).
    """
    newest: Dict[str, Dict[str, int]] = {}
    roles: Dict[str, Any] = {}
    for r in records:
        if isinstance(r.get("staleness"), dict):
            newest[r["task"]] = r["staleness"]
            roles[r["task"]] = r.get("role")
    if any(role == "ps" for role in roles.values()):
        newest = {t: h for t, h in newest.items() if roles[t] == "ps"}
    total: Dict[int, int] = defaultdict(int)
    for histogram in newest.values():
        for k, count in histogram.items():
            total[int(k)] += int(count)
    return dict(sorted(total.items()))


def summary(records: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per task: last step, final loss, best loss, median steps/s."""
    out: Dict[str, Dict[str, Any]] = {}
    records = _task_records(records)
    for task in sorted({r["task"] for r in records}):
        mine = [r for r in records if r["task"] == task]
        losses = [r["loss"] for r in mine if "loss" in r]
        rates = sorted(r["steps_per_sec"] for r in mine if "steps_per_sec" in r)
        out[task] = {
            "last_step": max(r["step"] for r in mine),
            "final_loss": losses[-1] if losses else None,
            "best_loss": min(losses) if losses else None,
            "median_steps_per_sec": rates[len(rates) // 2] if rates else None,
        }
    return out


def panels(records: List[Dict[str, Any]]) -> List[Panel]:
    """The report's plots as data, in dashboard order; panels with nothing recorded are left out."""
    records = _task_records(records)
    loss = _series(records, "loss")
    out = [
        Panel("loss_vs_step", "Training loss against step", "global step", "loss (mean of each window)",
              {t: [(p[0], p[2]) for p in s] for t, s in sorted(loss.items())}),
        Panel("loss_vs_time", "Training loss against wall time", "seconds since start", "loss",
              {t: [(p[1], p[2]) for p in s] for t, s in sorted(loss.items())}),
        Panel("accuracy", "Test accuracy", "global step", "accuracy",
              {t: [(p[0], p[2]) for p in s] for t, s in sorted(_series(records, "accuracy").items())}, smooth=False),
    ]
    throughput: Dict[str, List[tuple]] = {}
    for field, what in (("steps_per_sec", "steps/s"), ("pushes_per_sec", "pushes/s"), ("pulls_per_sec", "pulls/s")):
        for task, s in sorted(_series(records, field).items()):
            throughput[f"{task} {what}"] = [(p[1], p[2]) for p in s]
    out.append(Panel("throughput", "Throughput per task", "seconds since start", "per second", throughput, log_y=False))
    histogram = staleness_histogram(records)
    out.append(Panel("staleness", "Gradient staleness (pushes per staleness)", "staleness (steps behind the ps)", "pushes",
                     bars={k: v for k, v in histogram.items()}))
    gradients: Dict[str, List[tuple]] = {}
    for field, what in (("held", "held"), ("dropped_stale", "dropped (total)")):
        for task, s in sorted(_series(records, field, roles=("ps",)).items()):
            if any(p[2] for p in s):
                gradients[f"{task} {what}"] = [(p[0], p[2]) for p in s]
    out.append(Panel("ps_gradients", "ps: gradients held (sync) and dropped (stale)", "global step", "gradients",
                     gradients, smooth=False, log_y=False))
    rows = {f"{t} rows": [(p[0], p[2]) for p in s] for t, s in sorted(_series(records, "rows", roles=("ps",)).items())}
    out.append(Panel("table_rows", "ps: embedding table rows", "global step", "rows", rows, smooth=False, log_y=False))
    return [p for p in out if not p.is_empty]


def _results(logdir: str) -> Dict[str, Any]:
    """The run's final numbers (`metrics.json`, `towerflow.training.save_metrics`), when the script wrote them."""
    path = os.path.join(logdir, _files.RESULTS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_summary(records: List[Dict[str, Any]], results: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Tasks and their states, mode, steps, final accuracy, wall time, failures and restarts."""
    results = results or {}
    state = run_state(records)
    mine = _task_records(records)
    mode = results.get("mode") or next((r["mode"] for r in reversed(mine) if isinstance(r.get("mode"), str)), None)
    accuracy = results.get("accuracy")
    if accuracy is None:
        accuracy = next((r["accuracy"] for r in reversed(mine) if "accuracy" in r), None)
    return {
        "state": state.state, "line": state.describe(), "tasks": {t: s.describe() for t, s in sorted(state.tasks.items())},
        "errors": {t: s.error for t, s in state.tasks.items() if s.error},
        "mode": mode, "global_step": max((r["step"] for r in mine), default=0), "accuracy": accuracy,
        "wall_s": state.wall_s, "failures": state.failures, "restarts": state.restarts,
    }


def _markdown(logdir: str, records, run: Dict[str, Any], images: List[str]) -> str:
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    lines = [f"# Report for `{logdir}`", "", f"**Run {run['line']}.**", ""]
    lines += ["| | |", "| --- | --- |", f"| tasks | {len(run['tasks'])} |", f"| mode | {run['mode'] or '-'} |",
              f"| global step | {run['global_step']} |", f"| final test accuracy | {fmt(run['accuracy'], '.4f')} |",
              f"| wall time | {run['wall_s']:.1f} s |", f"| failures | {run['failures']} |", f"| restarts | {run['restarts']} |",
              ""]
    lines += ["| task | state | last step | final loss | best loss | median steps/s |", "| --- | --- | --- | --- | --- | --- |"]
    for task, s in summary(records).items():
        lines.append(f"| {task} | {run['tasks'].get(task, '-')} | {s['last_step']} | {fmt(s['final_loss'], '.4f')} | "
                     f"{fmt(s['best_loss'], '.4f')} | {fmt(s['median_steps_per_sec'], '.2f')} |")
    for task, error in sorted(run["errors"].items()):
        lines.append(f"\n{task} failed: `{error}`")
    histogram = staleness_histogram(records)
    if histogram:
        lines += ["", "Staleness histogram (pushes per staleness): " + ", ".join(f"{k}: {v}" for k, v in histogram.items())]
    lines += [""] + [f"![{name}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def write_report(logdir: str, out_dir: Optional[str] = None) -> List[str]:
    """Write the PNGs, `dashboard.png` and `report.md` into `out_dir` (default LOGDIR/report); returns the files written."""
    if not os.path.isdir(logdir):
        raise FileNotFoundError(f"{logdir!r} is not a folder; expected the --logdir of a job (it holds "
                                f"{_files.METRICS_FILE}). Check the path, or run a job with --logdir {logdir}")
    records = read_metrics(logdir)
    if not _task_records(records):
        raise ValueError(f"{logdir!r} has no metrics records; run a job with --logdir {logdir} first")
    out_dir = out_dir or os.path.join(logdir, "report")
    os.makedirs(out_dir, exist_ok=True)
    run = run_summary(records, _results(logdir))
    drawn = panels(records)
    images = [DASHBOARD] + [f"{p.name}.png" for p in drawn]
    title = f"{logdir}: {run['line']}" + (f", test accuracy {run['accuracy']:.4f}" if run["accuracy"] is not None else "")
    save_dashboard(os.path.join(out_dir, DASHBOARD), drawn, title)
    for panel in drawn:
        save_panel(os.path.join(out_dir, f"{panel.name}.png"), panel)
    report = os.path.join(out_dir, REPORT)
    with atomic_write(report, "w") as f:
        f.write(_markdown(logdir, records, run, images))
    return [os.path.join(out_dir, name) for name in images] + [report]
