"""Drawing the report's panels with matplotlib: one PNG per panel and one dashboard of them all.

The look TensorBoard and Weights & Biases taught: every point drawn faint, an EMA-smoothed line
over it in the same colour, a log scale when the values span more than two decades, a grid, a
legend per task. `Panel` is the data (what `report.py` feeds here; tests read it back); this
module only draws. Files are written atomically.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from towerflow._io import atomic_write

Points = List[Tuple[float, float]]
LOG_SPAN = 100.0  # more than two decades between the smallest and largest positive value: log scale
DPI = 110


@dataclasses.dataclass
class Panel:
    """One plot: curves (label -> (x, y) points) or a bar chart (`bars`: x -> height)."""

    name: str  # the PNG's file name without .png
    title: str
    xlabel: str
    ylabel: str
    curves: Dict[str, Points] = dataclasses.field(default_factory=dict)
    bars: Dict[float, float] = dataclasses.field(default_factory=dict)
    smooth: bool = True
    log_y: Optional[bool] = None  # None: decide from the values (LOG_SPAN)

    @property
    def is_empty(self) -> bool:
        return not self.bars and not any(self.curves.values())

    def wants_log(self) -> bool:
        if self.log_y is not None:
            return self.log_y
        return spans_decades([y for points in self.curves.values() for _, y in points])


def spans_decades(values: Sequence[float], span: float = LOG_SPAN) -> bool:
    """Whether positive values range over more than `span` (max / min): a log axis shows them better."""
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    return len(positive) > 1 and max(positive) / min(positive) > span and min(values) > 0


def ema(values: Sequence[float], weight: Optional[float] = None) -> List[float]:
    """TensorBoard's smoothing: a debiased exponential moving average. The default weight grows
    with the number of points (0.6 for a few, 0.95 for hundreds)."""
    if weight is None:
        weight = min(0.95, max(0.6, 1 - 8 / max(1, len(values))))
    out, last, n = [], 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(out[-1] if out else v)
            continue
        n += 1
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight ** n))
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(ax, panel: Panel) -> None:
    """Draw `panel` into a matplotlib Axes."""
    ax.set_title(panel.title, fontsize=11)
    ax.set_xlabel(panel.xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if panel.is_empty:
        ax.text(0.5, 0.5, "nothing recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
        return
    if panel.bars:
        ax.bar(list(panel.bars), list(panel.bars.values()), color="tab:blue", alpha=0.8)
        return
    log_y = panel.wants_log()
    for i, (label, points) in enumerate(sorted(panel.curves.items())):
        if not points:
            continue
        color = f"C{i % 10}"
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        if panel.smooth and len(points) >= 8:
            ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
            # on a log axis the average of the logs (a geometric mean) follows the points, not their spikes
            smooth = [math.exp(v) for v in ema([math.log(y) for y in ys])] if log_y else ema(ys)
            ax.plot(xs, smooth, color=color, linewidth=1.8, label=f"{label} (smoothed)")
        else:
            ax.plot(xs, ys, color=color, linewidth=1.5, marker="." if len(points) < 30 else None, label=label)
    if log_y:
        ax.set_yscale("log")
    ax.legend(fontsize=8)


def save_panel(path: str, panel: Panel) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax, panel)
    fig.tight_layout()
    _save(plt, fig, path)


def save_dashboard(path: str, panels: Sequence[Panel], title: str) -> None:
    """Every panel in one PNG, two to a row, under `title` (the run's one-line summary)."""
    plt = _pyplot()
    rows = max(1, math.ceil(len(panels) / 2))
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.6 * rows + 0.6), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        draw(ax, panel)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    _save(plt, fig, path)


def _save(plt, fig, path: str) -> None:
    with atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=DPI)
    plt.close(fig)


def plot_curves(path: str, title: str, xlabel: str, ylabel: str, curves: Dict[str, Points],
                smooth: int = 1, log_y: bool = False) -> None:
    """One PNG with a line per label from (x, y) points (benchmarks draw their docs/ plots with it).

    `smooth=k` draws the running mean of k points instead of the raw ones.
    """
    if smooth > 1:
        curves = {label: _running_mean(points, smooth) for label, points in curves.items()}
    save_panel(path, Panel("plot", title, xlabel, ylabel, dict(curves), smooth=False, log_y=log_y))


def _running_mean(points: Points, k: int) -> Points:
    if len(points) < k:
        return list(points)
    ys = [p[1] for p in points]
    return [(points[i][0], sum(ys[i - k + 1 : i + 1]) / k) for i in range(k - 1, len(points))]
