"""`LaunchConfig`: what one `towerflow launch` line asks for, parsed and typed.

The command line only parses flags into this (cli/launch.py); planning reads nothing else
(launch/planning.py), so a program that launches a cluster builds a LaunchConfig itself, and the
command line and a test plan from the same data. torch's `run.py` splits its launcher the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One launch: the script, the cluster to start (embedded, one task of a file, or a scheduler's slot)."""

    script: str
    script_args: Tuple[str, ...] = ()
    # the embedded cluster on this machine
    ps: int = 0
    workers: Optional[int] = None
    chief: bool = False
    devices: Optional[str] = None
    nproc: Optional[int] = None
    # under a scheduler
    evaluator: bool = False
    scheduler: Optional[str] = None
    # one task of a multi-host cluster
    cluster_file: Optional[str] = None
    job_name: Optional[str] = None
    task_index: Optional[int] = None
    master_port: Optional[int] = None
    # every task
    max_restarts: int = 0
    logdir: Optional[str] = None
    store: Optional[str] = None  # etcd://...: the cluster's rendezvous store; None: the embedded c10d store
    ps_runs_script: bool = False
    # the parameter servers' update mode
    mode: Optional[str] = None
    replicas_to_aggregate: Optional[int] = None
    staleness: Optional[int] = None
    local_steps: Optional[int] = None
    ps_replicas: Optional[int] = None
    ps_replica_lag: Optional[int] = None
    dense: Optional[str] = None  # "allreduce": only the tables on the ps tasks, the rest all-reduced (hybrid)
    # the ps tasks publish the rows changed every this many seconds, to this folder (None: LOGDIR/publish)
    publish_every: Optional[float] = None
    publish_to: Optional[str] = None
    snapshot_every: Optional[int] = None  # a snapshot in the folder after every K deltas (None: by volume)
    # a window of each task's training steps under torch.profiler: (from global step, how many)
    profile: Optional[Tuple[int, int]] = None

    def ps_mode_flag(self) -> Optional[str]:
        """The first update-mode flag given, as the user wrote it (for messages), or None."""
        if self.mode is not None:
            return f"--mode {self.mode}"
        return f"--local-steps {self.local_steps}" if self.local_steps is not None else None
