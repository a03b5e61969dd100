"""The names tasks are called by: one per incarnation of a task ('ps:1', then 'ps:1:r2' once restarted twice).

A restarted task serves under a new name, so a call meant for a dead incarnation fails instead of
reaching its successor mid-recovery. Callers address a task through `Server.call_name_of`, which
finds the current incarnation.
"""

from __future__ import annotations

from typing import Optional, Tuple


def call_name(job: str, index: int, incarnation: int = 0) -> str:
    """The call name of one incarnation of a task."""
    return f"{job}:{index}" if incarnation == 0 else f"{job}:{index}:r{incarnation}"


def task_of(name: str) -> Tuple[str, int]:
    """(job, index) of an incarnation's call name ('ps:1:r2' -> ('ps', 1))."""
    job, index = name.split(":")[:2]
    return job, int(index)


def lost_task(name: str) -> Tuple[Optional[str], Optional[int]]:
    """The task ('/job:ps/task:1') and incarnation (2) of call name 'ps:1:r2', as a lost peer names them;
    (name, None) for a name that is not a call name (a peer nobody published)."""
    parts = name.split(":")
    try:
        job, index = parts[0], int(parts[1])
        incarnation = int(parts[2][1:]) if len(parts) == 3 and parts[2].startswith("r") else 0
    except (IndexError, ValueError):
        return name, None
    if len(parts) > 3 or not job:
        return name, None
    return f"/job:{job}/task:{index}", incarnation
