"""Device scopes: the thread-local stack behind `with towerflow.device(...)`, and how a spec
becomes a concrete device (TF's rules: partial specs pick the first GPU, else the CPU;
absent devices fall back to the CPU only under soft placement).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Callable, Dict, List, Optional, Union

import torch

from towerflow import config as _config
from towerflow.devices import logical as _logical
from towerflow.devices.spec import DeviceLike, DeviceSpec
from towerflow.errors import PlacementError


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """What a device function is told about the op being placed (TF passes the Operation)."""

    name: str  # e.g. "add", "linear"; for parameters, the module-qualified name ("fc1.weight")
    type: str  # e.g. "Add", "Linear"; "Variable" for parameters and buffers


DeviceFunction = Callable[[OpInfo], Union[str, DeviceSpec, None]]


class Target:
    """A resolved placement: the logical device an op runs on, and why if it is not the one asked for."""

    __slots__ = ("device", "torch_device", "is_split", "index", "fallback", "requested")

    def __init__(self, device: _logical.LogicalDevice, fallback: Optional[str] = None, requested: Optional[str] = None):
        self.device = device
        self.torch_device = device.torch_device
        self.is_split = device.is_split
        self.index = device.index
        self.fallback = fallback
        self.requested = requested


_cache: Dict[DeviceSpec, Target] = {}
_generation = [0]  # bumped on every config change, so frames re-resolve
_live_frames: "weakref.WeakSet[Frame]" = weakref.WeakSet()


def _forget(old: _config.Config, new: _config.Config) -> None:
    _cache.clear()
    _generation[0] += 1
    for frame in list(_live_frames):
        frame.fast_device = None


_config.on_change(apply=_forget)
_logical.on_identity_change(lambda: _forget(None, None))


def resolve(spec: DeviceSpec, op: str) -> Target:
    """The device `spec` means on this task; raises PlacementError when it cannot be honoured."""
    cached = _cache.get(spec)
    if cached is not None:
        return cached
    table = _logical.table()
    here = _logical.local_task()
    if (spec.job is not None and spec.job != here.job) or (spec.task is not None and spec.task != here.task):
        raise PlacementError(
            f"op {op!r} asks for {spec}, which is another task; this process is {here}. Ops run in the "
            "process that executes them: send the work there with towerflow.function / towerflow.remote "
            "(docs/cluster.md), or name a device of this task such as '/cpu:0'.",
            op=op,
            requested=str(spec),
            available=table.names(),
        )
    device_type = spec.device_type or ("GPU" if table.has_type("GPU") else "CPU")
    index = spec.device_index or 0
    device = table.lookup(device_type, index)
    target = None
    if device is not None:
        target = Target(device)
        if device.is_split:
            _logical.mark_split_in_use()
    else:
        wanted = f"/device:{device_type}:{index}"
        reason = table.absence(device_type, index)
        if not _config.current().allow_soft_placement:
            raise PlacementError(
                f"cannot place op {op!r} on {wanted}: {reason}. Name an existing device, or let towerflow "
                "fall back to the CPU with towerflow.configure(allow_soft_placement=True).",
                op=op,
                requested=wanted,
                available=table.names(),
            )
        target = Target(table.lookup("CPU", 0), fallback=reason, requested=wanted)
    _cache[spec] = target
    return target


class Frame:
    """One `with device(...)` level: a fixed spec, or a device function asked per op."""

    __slots__ = ("spec", "fn", "outer", "is_static", "_merged", "_target", "_generation", "fast_device", "fast_is_cpu", "__weakref__")

    def __init__(self, spec: Optional[DeviceSpec], fn: Optional[DeviceFunction], outer: Optional["Frame"]):
        self.spec = spec
        self.fn = fn
        self.outer = outer
        self.is_static = fn is None and (outer is None or outer.is_static)
        self._merged = (outer._merged if outer is not None else DeviceSpec()).merge(spec) if self.is_static else None
        self._target: Optional[Target] = None
        self._generation = -1
        # Set when ops here need nothing but a device check: a resolved, unsplit device and the log off.
        # A config change clears it (see _forget), so the hot path reads just this one attribute.
        self.fast_device: Optional[torch.device] = None
        self.fast_is_cpu = False
        if self.is_static:
            _live_frames.add(self)

    def merged_spec(self, op: OpInfo) -> DeviceSpec:
        if self.is_static:
            return self._merged
        base = self.outer.merged_spec(op) if self.outer is not None else DeviceSpec()
        chosen = self.spec if self.fn is None else self.fn(op)
        return base if chosen is None else base.merge(chosen)

    def target(self, op: OpInfo) -> Target:
        if not self.is_static:
            return resolve(self.merged_spec(op), op.name)
        if self._generation != _generation[0]:  # config changed since we resolved
            self._target = resolve(self._merged, op.name)
            self._generation = _generation[0]
            quiet = not _config.current().log_device_placement
            self.fast_device = self._target.torch_device if quiet and not self._target.is_split else None
            self.fast_is_cpu = self._target.torch_device.type == "cpu"
        return self._target


class _ThreadState(threading.local):
    def __init__(self):
        self.frames: List[Frame] = []


state = _ThreadState()


def top() -> Optional[Frame]:
    frames = state.frames
    if frames:
        return frames[-1]
    return _default_frame


_default_frame: Optional[Frame] = None


def _set_default(old: _config.Config, new: _config.Config) -> None:
    global _default_frame
    device = new.default_device
    _default_frame = None if device is None else Frame(DeviceSpec() if device == "auto" else device, None, None)


_config.on_change(apply=_set_default)


def make_frame(device: Union[DeviceLike, DeviceFunction]) -> Frame:
    outer = top()
    if callable(device) and not isinstance(device, (str, DeviceSpec, torch.device)):
        return Frame(None, device, outer)
    return Frame(DeviceSpec.parse(device), None, outer)
