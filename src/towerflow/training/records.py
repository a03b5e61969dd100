"""What a run leaves in its logdir besides the per-step metrics: its final numbers, one JSON file."""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from towerflow import _files
from towerflow._io import atomic_write


def save_metrics(logdir: str, record: Dict[str, Any], name: str = _files.RESULTS_FILE) -> str:
    """Write `record` as JSON to `logdir/name`, atomically; returns the path."""
    path = os.path.join(logdir, name)
    with atomic_write(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    return path
