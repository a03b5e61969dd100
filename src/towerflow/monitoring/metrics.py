"""`<logdir>/metrics.jsonl`: one JSON object per line, appended by every task of a job.

The live view (`towerflow top`) and the plots (`towerflow report`) read only this file, so
they work on a finished job, on another machine, or while the job runs. Each record is one
`write()` of a whole line to a file opened for appending, so lines from concurrent tasks do
not interleave on a local filesystem; a reader skips a torn last line.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

from towerflow import _files
from towerflow.monitoring.tensorboard import open_mirror

# Fields the views understand; `time`, `task` and `step` are always there. `staleness` is the
# task's cumulative histogram {"k": pushes}; `bytes_*` are totals since the task started.
# Records may carry more fields (a strategy's own counters); the views ignore them.
FIELDS = (
    "time", "task", "role", "device", "step", "loss", "steps_per_sec", "samples_per_sec",
    "staleness", "bytes_pushed", "bytes_pulled", "device_memory_mib", "event",
    # ps tasks: rates since their previous record, what they hold and dropped, table rows
    "pushes_per_sec", "pulls_per_sec", "updates_per_sec", "held", "dropped_stale", "rows",
    # ps tasks with --ps-replicas 2: the backup's call name, ops not acknowledged yet, unreplicated, ops sent
    "replica_backup", "replica_lag", "replica_degraded", "replica_ops",
    # every task: how it started and ended (runstate.py turns them into running / finished / failed)
    "restarts", "error", "exit_code", "accuracy",
)

# Events with a meaning for the run's state (runstate.py); others (checkpoints) are notes.
EVENT_START, EVENT_END, EVENT_FAILED, EVENT_EXIT = "start", "end", "failed", "exit"
EVENT_RUN_START, EVENT_RUN_END = "run start", "run end"


class MetricsWriter:
    """Appends records for one task; thread-safe; cheap enough to call every step."""

    def __init__(self, logdir: str, task: str, role: Optional[str] = None, device: Optional[str] = None,
                 tensorboard: bool = False):
        os.makedirs(logdir, exist_ok=True)
        self.path = os.path.join(logdir, _files.METRICS_FILE)
        self.task = task
        self._static = {k: v for k, v in (("role", role), ("device", device)) if v is not None}
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")
        # the same numbers for TensorBoard when it is installed (monitoring/tensorboard.py)
        self._mirror = open_mirror(logdir, task) if tensorboard else None

    def write(self, step: int, **values: Any) -> None:
        record = {"time": round(time.time(), 3), "task": self.task, "step": int(step), **self._static}
        record.update({k: v for k, v in values.items() if v is not None})
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file.closed:
                return  # a late record (a daemon thread) after the task closed its writer
            self._file.write(line)
            self._file.flush()
            if self._mirror is not None:
                self._mirror.write(record)

    def close(self) -> None:
        with self._lock:
            self._file.close()
            if self._mirror is not None:
                self._mirror.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(logdir_or_file: str) -> List[Dict[str, Any]]:
    """Every complete record, in file order; a torn or foreign line is skipped."""
    return list(iter_metrics(logdir_or_file))


def metrics_path(logdir_or_file: str) -> str:
    """The metrics file of a log directory; a clear error when there is none."""
    path = logdir_or_file
    if os.path.isdir(path):
        path = os.path.join(path, _files.METRICS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{logdir_or_file!r}: expected a log directory holding {_files.METRICS_FILE} (or the "
                                f"file itself); none at {path!r}. Run a job with --logdir {logdir_or_file} first")
    return path


def iter_metrics(logdir_or_file: str) -> Iterator[Dict[str, Any]]:
    path = metrics_path(logdir_or_file)
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                return  # the writer is mid-line
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "task" in record and "step" in record:
                yield record
