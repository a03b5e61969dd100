"""Placement: `with towerflow.device(...)` scopes, soft placement and the placement log."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Union

from towerflow.devices.spec import DeviceLike
from towerflow.placement import modules as _modules
from towerflow.placement.log import PlacementLog, PlacementRecord, PlacementSummary, placement_log
from towerflow.placement.mode import sync as _sync
from towerflow.placement.scope import DeviceFunction, OpInfo, make_frame, state as _state

__all__ = ["device", "placement_log", "PlacementLog", "PlacementRecord", "PlacementSummary", "OpInfo"]

_active_lock = threading.Lock()
_active_scopes = 0  # across threads; module registration hooks live while this is non-zero


def _count_scope(delta: int) -> None:
    global _active_scopes
    with _active_lock:
        _active_scopes += delta
        _modules.watch_registrations(_active_scopes > 0)


@contextlib.contextmanager
def device(device_or_function: Union[DeviceLike, DeviceFunction]) -> Iterator[None]:
    """Place what runs inside on a device, like `tf.device`.

    Takes a TF or torch device string, a DeviceSpec, a torch.device, or a device function
    called per op with an `OpInfo` and returning one of those (or None for no constraint).
    Nested scopes merge: inner fields override, unset ones inherit.
    """
    frame = make_frame(device_or_function)  # a malformed spec fails here, before anything changes
    _state.frames.append(frame)
    _count_scope(+1)
    _sync()
    try:
        yield
    finally:
        _state.frames.pop()
        _count_scope(-1)
        _sync()
