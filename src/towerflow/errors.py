"""The exceptions towerflow raises, in one small hierarchy.

Every class can cross a process boundary (pickle) intact, so an error raised on a
remote task reaches the caller with its message and fields.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Optional, Sequence


class TowerflowError(Exception):
    """Raised for any towerflow-specific failure; catch this to catch them all."""


class DeviceSpecError(TowerflowError, ValueError):
    """Raised when a device string does not follow the TF device grammar."""


class ConfigError(TowerflowError, ValueError):
    """Raised when a configuration value is invalid or can no longer take effect."""


class PlacementError(TowerflowError, RuntimeError):
    """Raised when an op asks for a device that cannot run it and soft placement is off."""

    def __init__(
        self,
        message: str,
        op: Optional[str] = None,
        requested: Optional[str] = None,
        available: Sequence[str] = (),
    ):
        super().__init__(message)
        self.op = op
        self.requested = requested
        self.available = tuple(available)

    def __reduce__(self):
        return (type(self), (str(self), self.op, self.requested, self.available))


class StrategyError(TowerflowError, RuntimeError):
    """Raised when a training strategy cannot be built from its arguments or the task's environment."""


class DataError(TowerflowError, ValueError):
    """Raised when a dataset path, file format or sharding request is invalid."""


class ClusterError(TowerflowError, RuntimeError):
    """Raised when a cluster cannot be formed or used: bad spec, missing task, refused join, failed call."""

    def __init__(self, message: str, task: Optional[str] = None):
        super().__init__(message)
        self.task = task  # the task the error is about, e.g. '/job:worker/task:1', when there is one

    def __reduce__(self):
        return (type(self), (str(self), self.task))


class ClusterSpecError(ClusterError, ValueError):
    """Raised when a cluster description (dict, JSON, flags, TF_CONFIG, torchrun variables) is invalid."""


class TaskEnvironmentError(ClusterSpecError, StrategyError, ConfigError):
    """Raised when a variable of the task environment has a value towerflow cannot use."""


class SchedulerError(ClusterSpecError):
    """Raised when a scheduler's environment (Slurm, MPI, Kubernetes, torchrun) cannot be resolved to a cluster."""


class ClusterTimeoutError(ClusterError, TimeoutError):
    """Raised when the tasks of a cluster did not all come up within the join timeout."""

    def __init__(self, message: str, task: Optional[str] = None, missing: Sequence[str] = ()):
        super().__init__(message, task)
        self.missing = tuple(missing)  # the tasks that never came up, as '/job:x/task:i'

    def __reduce__(self):
        return (type(self), (str(self), self.task, self.missing))


class ClusterJoinError(ClusterError):
    """Raised when a task is refused by the cluster: port in use, slot taken, spec or token mismatch."""


class PeerLost(ClusterError):
    """Raised when a task cannot go on because another task (`task`) failed, vanished or stopped answering."""

    def __init__(self, message: str, task: Optional[str] = None, incarnation: Optional[int] = None):
        super().__init__(message, task)
        self.incarnation = incarnation  # which incarnation of `task` was lost (0: never restarted), when known

    def __reduce__(self):
        return (type(self), (str(self), self.task, self.incarnation))


class ConnectionLost(PeerLost):
    """Raised by a call or a same-host link whose other end is gone (its process ended, its host went away, a
    restarted incarnation replaced it, or it never joined): unlike a plain PeerLost, that task may be back."""


class PSTaskLost(PeerLost):
    """Raised by a worker's call to a ps task that is gone: the part of ps task `part` is then recovered from
    `name`'s restart or a backup (ps/worker/recovery.py)."""

    def __init__(self, part: int, name: str, reason: str, task: Optional[str] = None, incarnation: Optional[int] = None):
        super().__init__(f"/job:ps/task:{part} (call name {name}) is gone: {reason}", task, incarnation)
        self.part = part  # the ps task whose part is lost (its own call name, or its promoted backup's)
        self.name = name  # the call name of the incarnation that is gone
        self.reason = str(reason)

    def __reduce__(self):
        return (type(self), (self.part, self.name, self.reason, self.task, self.incarnation))


class ClusterLeftError(ClusterError):
    """Raised by a wait on other tasks once this task has left the cluster (its store let go): nothing to wait for."""


class RemoteError(ClusterError):
    """Raised when a remote call failed with an exception that could not be sent back as itself."""

    def __init__(self, message: str, task: Optional[str] = None, remote_type: Optional[str] = None, remote_traceback: str = ""):
        super().__init__(message, task)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return (type(self), (str(self), self.task, self.remote_type, self.remote_traceback))


class LaunchError(TowerflowError, RuntimeError):
    """Raised when `towerflow launch` gets flags that cannot describe a cluster, or a task fails."""


class CheckpointError(TowerflowError, RuntimeError):
    """Raised when no usable checkpoint can be read or written."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """Raised when a checkpoint's tensors do not fit the model it is restored into."""

    def __init__(self, message: str, missing: Sequence[str] = (), unexpected: Sequence[str] = (), mismatched: Sequence[str] = ()):
        super().__init__(message)
        self.missing = tuple(missing)  # in the model, not in the checkpoint
        self.unexpected = tuple(unexpected)  # in the checkpoint, not in the model
        self.mismatched = tuple(mismatched)  # in both, with different shapes or dtypes

    def __reduce__(self):
        return (type(self), (str(self), self.missing, self.unexpected, self.mismatched))


class ParameterServerError(StrategyError):
    """Raised when parameter-server training cannot start or go on: bad mode, optimizer, or a ps that is not ready."""


class LayoutError(ParameterServerError, ValueError):
    """Raised when variables cannot be placed on ps tasks as asked (bad placement, partition or shape)."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A ' Did you mean ...?' suffix for an unknown name, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""
