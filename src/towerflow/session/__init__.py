"""The monitored training session: restore, hooks, checkpoints and metrics around a training loop."""

from towerflow.session.checkpoint import CheckpointInfo, CheckpointManager, RestoredState
from towerflow.session.hooks import (
    CheckpointHook,
    LoggingHook,
    NanGuardHook,
    NanLossError,
    ProgressHook,
    SessionHook,
    StopAtStepHook,
    SummaryHook,
)
from towerflow.session.monitored import MonitoredTrainingSession
from towerflow.session.profiling import ProfilerHook

__all__ = [
    "CheckpointHook",
    "CheckpointInfo",
    "CheckpointManager",
    "LoggingHook",
    "MonitoredTrainingSession",
    "NanGuardHook",
    "NanLossError",
    "ProfilerHook",
    "ProgressHook",
    "RestoredState",
    "SessionHook",
    "StopAtStepHook",
    "SummaryHook",
]
