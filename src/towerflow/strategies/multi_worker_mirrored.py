"""Synchronous all-reduce across workers on several hosts: TF's `MultiWorkerMirroredStrategy`.

The mechanics are `MirroredStrategy`'s (one process per replica, DDP over the replica process
group); what differs is the cluster view: the task's job and index come from TF_CONFIG, the
chief is the `chief` task (or worker 0), and each worker computes on the device the launcher
assigned it (TOWERFLOW_DEVICE), else its LOCAL_RANK-th GPU, else the host CPU.
"""

from __future__ import annotations

from towerflow.strategies.mirrored import MirroredStrategy


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """One replica per worker process across hosts, gradients all-reduced every step."""

    name = "multi_worker_mirrored"

    @property
    def task_type(self) -> str:
        return self.env.task_type or "worker"

    @property
    def task_id(self) -> int:
        return self.env.task_index if self.env.task_type else self.replica_id
