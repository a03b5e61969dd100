"""What a run leaves in its logdir, written atomically so a reader never sees half a file."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

METRICS_FILE = "metrics.json"


def save_metrics(logdir: str, record: Dict[str, Any], name: str = METRICS_FILE) -> str:
    """Write `record` as JSON to `logdir/name` (temporary file, fsync, os.replace); returns the path."""
    os.makedirs(logdir, exist_ok=True)
    path = os.path.join(logdir, name)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
