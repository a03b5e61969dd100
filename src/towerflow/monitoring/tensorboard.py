"""The metrics records' numbers as TensorBoard scalars, when tensorboard is installed.

`MetricsWriter(..., tensorboard=True)` hands every record to a `TensorBoardMirror`, which writes
each number in it (loss, steps/s, pushes/s, mean staleness, accuracy, ...) under
`LOGDIR/tensorboard/<task>`: one TensorBoard run per task, so `tensorboard --logdir
LOGDIR/tensorboard` draws one line per task, the same numbers as `towerflow report`.
Without tensorboard (`pip install 'towerflow[tensorboard]'`) `open_mirror` returns None.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

TENSORBOARD_DIR = "tensorboard"
_SKIP = ("time", "step", "local_step", "restarts", "exit_code", "updates", "pushes", "pulls")


def scalars(record: Dict[str, Any]) -> Dict[str, float]:
    """The numbers of a record worth a TensorBoard line; a staleness histogram becomes its mean."""
    out: Dict[str, float] = {}
    for key, value in record.items():
        if key in _SKIP or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif key == "staleness" and isinstance(value, dict) and value:
            total = sum(value.values())
            if total:
                out["staleness_mean"] = sum(int(k) * v for k, v in value.items()) / total
    return out


class TensorBoardMirror:
    """A SummaryWriter for one task's records."""

    def __init__(self, writer: Any):
        self.writer = writer

    def write(self, record: Dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"], walltime=record.get("time"))

    def close(self) -> None:
        self.writer.close()


def run_dir(logdir: str, task: str) -> str:
    return os.path.join(logdir, TENSORBOARD_DIR, task.replace(":", "_"))


def open_mirror(logdir: str, task: str) -> Optional[TensorBoardMirror]:
    """A mirror writing under LOGDIR/tensorboard/<task>, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return TensorBoardMirror(SummaryWriter(run_dir(logdir, task), flush_secs=10))
