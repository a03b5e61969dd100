"""`towerflow top LOGDIR`: one row per task from `metrics.jsonl`, refreshed in place.

It reads only the file, so it needs no access to the cluster and works after the job ended:
over a finished or failed run it prints that run's summary once and exits. The first line says
whether the run is running, finished or failed; each task's row says whether it is running,
finished, failed or stopped, and how often it was restarted. `q` quits the live view.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, Optional, TextIO

from towerflow.monitoring import _screen
from towerflow.monitoring.metrics import read_metrics
from towerflow.monitoring.runstate import LAUNCHER, RunState, run_state

COLUMNS = ("task", "role", "state", "device", "step", "steps/s", "loss", "staleness", "pushed", "pulled",
           "rows (+in -out)", "replica", "data (epoch: read)", "mem MiB", "age")
_LEFT = 4  # the first columns are text (left-aligned), the others numbers


def _rows(r: Dict[str, Any]) -> str:
    """A ps task's table rows, with the admissions and evictions so far (hash vocabularies)."""
    if "rows" not in r:
        return "-"
    return f"{r['rows']:,} (+{r.get('admitted', 0):,} -{r.get('evicted', 0):,})"


def _replica(r: Dict[str, Any]) -> str:
    """A ps task's backup and how many forwarded ops it has not acknowledged, or `degraded` (none: unreplicated)."""
    if "replica_degraded" not in r:
        return "-"
    return "degraded" if r["replica_degraded"] else f"{r.get('replica_backup')} lag {r.get('replica_lag', 0)}"


def _device(r: Dict[str, Any]) -> str:
    """`CPU:0` for `/job:worker/replica:0/task:0/device:CPU:0`: the task is in its own column."""
    device = str(r.get("device", "-"))
    return device.rsplit("device:", 1)[-1]


def _rate(r: Dict[str, Any]) -> str:
    """Steps/s of a worker; pushes/s (else updates/s) of a ps task."""
    for key in ("steps_per_sec", "pushes_per_sec", "updates_per_sec"):
        if key in r:
            return f"{r[key]:.1f}"
    return "-"


def _data(r: Dict[str, Any]) -> str:
    """A worker's position in its files: the epoch and the share of it read (records where the size is unknown)."""
    if "data_epoch" not in r:
        return "-"
    size = r.get("data_epoch_records")
    read = f"{100 * r['data_records'] / size:.0f}%" if size else f"{r['data_records']:,}"
    return f"{r['data_epoch']}: {read}"


def _bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _staleness(value: Any) -> str:
    """A histogram {"k": count} shows as its mean and max; a number as itself."""
    if isinstance(value, dict) and value:
        counts = {int(k): v for k, v in value.items()}
        total = sum(counts.values())
        mean = sum(k * v for k, v in counts.items()) / total if total else 0.0
        return f"{mean:.1f} (max {max(counts)})"
    if isinstance(value, (int, float)):
        return f"{value:.1f}"
    return "-"


def latest_by_task(records: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The newest values per task: later records override earlier ones field by field."""
    tasks: Dict[str, Dict[str, Any]] = {}
    for record in records:
        if record["task"] == LAUNCHER or record.get("role") == LAUNCHER:
            continue
        merged = tasks.setdefault(record["task"], {})
        merged.update({k: v for k, v in record.items() if k != "event"})
    return tasks


def rows(records: List[Dict[str, Any]], now: Optional[float] = None, state: Optional[RunState] = None) -> List[List[str]]:
    now = time.time() if now is None else now
    if state is None and records:
        state = run_state(records, now)
    out = []
    for task, r in sorted(latest_by_task(records).items()):
        task_state = state.tasks.get(task) if state is not None else None
        out.append([
            task,
            str(r.get("role", "-")),
            task_state.describe() if task_state is not None else "-",
            _device(r),
            str(r.get("step", "-")),
            _rate(r),
            f"{r['loss']:.4f}" if "loss" in r else "-",
            _staleness(r.get("staleness")),
            _bytes(r.get("bytes_pushed")),
            _bytes(r.get("bytes_pulled")),
            _rows(r),
            _replica(r),
            _data(r),
            str(r.get("device_memory_mib", "-")),
            f"{max(0.0, now - r['time']):.0f}s",
        ])
    return out


def render(records: List[Dict[str, Any]], logdir: str, now: Optional[float] = None, live: bool = False) -> str:
    now = time.time() if now is None else now
    state = run_state(records, now) if records else None
    table = [list(COLUMNS)] + rows(records, now, state)
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    run_line = state.describe(now) if state is not None else "no records yet"
    lines = [f"towerflow top — {logdir} — run {run_line} — {len(table) - 1} tasks, {len(records)} records"]
    for i, row in enumerate(table):
        lines.append("  ".join(cell.ljust(w) if j < _LEFT else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if state is not None:
        lines += [f"{t}: {s.error}" for t, s in sorted(state.tasks.items()) if s.error]
    if state is not None and state.is_over:
        lines.append(f"the run is over: this is its summary (plots: towerflow report {logdir})")
    elif live:
        lines.append("q quits")
    return "\n".join(lines)


def run(logdir: str, watch: Optional[float] = 2.0, out: TextIO = sys.stdout, max_frames: Optional[int] = None,
        keys: Optional[_screen.KeyReader] = None) -> int:
    """Draw the view; live (every `watch` s, until q) while the run goes on, once when it is over."""
    over = [False]

    def frame() -> str:
        records = read_metrics(logdir)
        over[0] = bool(records) and run_state(records).is_over
        return render(records, logdir, live=bool(watch))

    return _screen.show(frame, out, watch, max_frames, done=lambda: over[0], keys=keys)
