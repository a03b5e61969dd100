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


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A ' Did you mean ...?' suffix for an unknown name, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""
