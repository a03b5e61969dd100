"""`towerflow report LOGDIR`: PNG plots and a markdown summary of a job from `metrics.jsonl`."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Dict, List

from towerflow._io import atomic_write
from towerflow.monitoring.metrics import read_metrics

PLOTS = ("loss_vs_step.png", "loss_vs_time.png", "throughput.png", "staleness.png")


def _series(records: List[Dict[str, Any]], field: str) -> Dict[str, List[tuple]]:
    """Per task: (step, wall seconds since the job's first record, value) for records with `field`."""
    start = min(r["time"] for r in records)
    series: Dict[str, List[tuple]] = defaultdict(list)
    for r in records:
        if field in r:
            series[r["task"]].append((r["step"], r["time"] - start, r[field]))
    return series


def staleness_histogram(records: List[Dict[str, Any]]) -> Dict[int, int]:
    """All tasks' staleness histograms added up ({staleness: pushes}).

    A task's `staleness` is cumulative since it started, so its newest record counts.
    """
    newest: Dict[str, Dict[str, int]] = {}
    for r in records:
        if isinstance(r.get("staleness"), dict):
            newest[r["task"]] = r["staleness"]
    total: Dict[int, int] = defaultdict(int)
    for histogram in newest.values():
        for k, count in histogram.items():
            total[int(k)] += int(count)
    return dict(sorted(total.items()))


def summary(records: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per task: last step, final loss, best loss, median steps/s."""
    out: Dict[str, Dict[str, Any]] = {}
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


def plot_curves(path: str, title: str, xlabel: str, ylabel: str, curves: Dict[str, List[tuple]],
                smooth: int = 1, log_y: bool = False) -> None:
    """One PNG with a line per label from (x, y) points, written atomically.

    `smooth=k` draws the running mean of k points (noisy per-step losses). Benchmarks use this
    too, so every plot in docs/ comes out of the same code as `towerflow report`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in curves.items():
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        if smooth > 1 and len(ys) >= smooth:
            ys = [sum(ys[i - smooth + 1 : i + 1]) / smooth for i in range(smooth - 1, len(ys))]
            xs = xs[smooth - 1 :]
        ax.plot(xs, ys, label=label, marker="." if len(points) < 30 else None)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if log_y:
        ax.set_yscale("log")
    if curves:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def _plot(path: str, title: str, xlabel: str, ylabel: str, series: Dict[str, List[tuple]], x: int) -> None:
    curves = {task: [(p[x], p[2]) for p in points] for task, points in sorted(series.items())}
    plot_curves(path, title, xlabel, ylabel, curves)


def _histogram(path: str, histogram: Dict[int, int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(list(histogram), list(histogram.values()))
    ax.set(title="Gradient staleness (all tasks)", xlabel="staleness (steps behind the ps)", ylabel="pushes")
    fig.tight_layout()
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def write_report(logdir: str, out_dir: str = None) -> List[str]:
    """Write the plots and `report.md` into `out_dir` (default LOGDIR/report); returns the files written."""
    records = read_metrics(logdir)
    if not records:
        raise ValueError(f"{logdir!r} has no metrics records; run a job with --logdir {logdir} first")
    out_dir = out_dir or os.path.join(logdir, "report")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    loss = _series(records, "loss")
    _plot(os.path.join(out_dir, PLOTS[0]), "Loss against step", "global step", "loss", loss, x=0)
    _plot(os.path.join(out_dir, PLOTS[1]), "Loss against wall time", "seconds since start", "loss", loss, x=1)
    _plot(os.path.join(out_dir, PLOTS[2]), "Throughput per task", "global step", "steps/s", _series(records, "steps_per_sec"), x=0)
    written += [os.path.join(out_dir, p) for p in PLOTS[:3]]
    histogram = staleness_histogram(records)
    if histogram:
        _histogram(os.path.join(out_dir, PLOTS[3]), histogram)
        written.append(os.path.join(out_dir, PLOTS[3]))
    lines = [f"# Report for `{logdir}`", "", f"{len(records)} records from {len({r['task'] for r in records})} tasks.", ""]
    lines += ["| task | last step | final loss | best loss | median steps/s |", "| --- | --- | --- | --- | --- |"]
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    for task, s in summary(records).items():
        lines.append(
            f"| {task} | {s['last_step']} | {fmt(s['final_loss'], '.4f')} | {fmt(s['best_loss'], '.4f')} | "
            f"{fmt(s['median_steps_per_sec'], '.2f')} |"
        )
    if histogram:
        lines += ["", "Staleness histogram (pushes per staleness): " + ", ".join(f"{k}: {v}" for k, v in histogram.items())]
    lines += [""] + [f"![{p}]({p})" for p in (os.path.basename(w) for w in written)]
    report = os.path.join(out_dir, "report.md")
    with atomic_write(report, "w") as f:
        f.write("\n".join(lines) + "\n")
    return written + [report]
