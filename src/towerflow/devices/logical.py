"""The placement targets of this task: physical devices, renumbered and optionally split.

TF's rule for logical devices is kept: splitting GPU:0 in two makes /gpu:0 and /gpu:1
out of it, and the next physical GPU becomes /gpu:2. Every placement goes through
`table()`, which is rebuilt whenever the configuration changes.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch

from towerflow import config as _config
from towerflow import taskenv as _taskenv
from towerflow.devices import gpu_memory as _gpu_memory  # noqa: F401  (registers the GPU options before this layer's)
from towerflow.devices import physical as _physical
from towerflow.devices.spec import DeviceSpec
from towerflow.errors import ConfigError, did_you_mean

def local_task() -> DeviceSpec:
    """This process's place in the cluster: the task a Server made it, else the one its environment names
    (the launcher's), `/job:localhost/replica:0/task:0` outside one."""
    if _local is not None:
        return _local
    task = _taskenv.from_environment().identity
    return DeviceSpec(job=task.job_name or "localhost", replica=0, task=task.task_index or 0)


_identity_listeners: List[Callable[[], None]] = []


def set_local_task(job: str, task: int) -> None:
    """Become `/job:<job>/task:<task>` (a Server calls this when it starts, as a TF server names its process's
    devices): device names and cached placements follow."""
    global _table, _local
    with _lock:
        _local = DeviceSpec(job=job, replica=0, task=task)
        _table = None
    for listener in _identity_listeners:
        listener()


def on_identity_change(listener: Callable[[], None]) -> None:
    _identity_listeners.append(listener)


@dataclasses.dataclass(frozen=True)
class LogicalDevice:
    """A device towerflow can place ops on; `name` is its full TF name."""

    name: str
    device_type: str
    index: int
    torch_device: torch.device
    physical: _physical.PhysicalDevice
    memory_limit_bytes: Optional[int] = None
    is_split: bool = False  # True when the physical device also backs other logical devices

    @property
    def short_name(self) -> str:
        return f"/device:{self.device_type}:{self.index}"

    @property
    def memory_bytes(self) -> Optional[int]:
        return self.memory_limit_bytes or self.physical.memory_bytes

    @property
    def compute_capability(self) -> Optional[Tuple[int, int]]:
        return self.physical.compute_capability

    @property
    def pci_bus_id(self) -> Optional[str]:
        return self.physical.pci_bus_id

    def describe(self) -> str:
        text = self.physical.describe()
        if self.is_split:
            limit = f", memory limit: {self.memory_limit_bytes >> 20} MiB" if self.memory_limit_bytes else ""
            text = f"logical device of {self.physical.device_type}:{self.physical.index} ({text}{limit})"
        return text

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "device_type": self.device_type,
            "index": self.index,
            "torch_device": str(self.torch_device),
            "memory_bytes": self.memory_bytes,
            "compute_capability": ".".join(map(str, self.compute_capability)) if self.compute_capability else None,
            "pci_bus_id": self.pci_bus_id,
            "physical": f"{self.physical.device_type}:{self.physical.index}",
            "description": self.physical.name,
            "is_logical_split": self.is_split,
        }


class DeviceTable:
    """Lookup of logical devices by (type, index), plus the reverse map from torch devices."""

    def __init__(self, devices: List[LogicalDevice]):
        self.devices = devices
        self._by_key: Dict[Tuple[str, int], LogicalDevice] = {(d.device_type, d.index): d for d in devices}
        self.has_split = any(d.is_split for d in devices)
        self.name_cache: Dict[tuple, str] = {}  # (torch.device, logical tag) -> full name, filled by the log
        self._first_on_physical: Dict[torch.device, LogicalDevice] = {}
        for d in devices:
            self._first_on_physical.setdefault(d.torch_device, d)

    def lookup(self, device_type: str, index: int) -> Optional[LogicalDevice]:
        return self._by_key.get((device_type, index))

    def has_type(self, device_type: str) -> bool:
        return (device_type, 0) in self._by_key

    def for_torch_device(self, device: torch.device) -> Optional[LogicalDevice]:
        """The logical device a tensor with no towerflow tag is on: the first one of its physical device."""
        found = self._first_on_physical.get(device)
        if found is None and device.type == "cuda" and device.index is None:
            found = self._first_on_physical.get(torch.device("cuda", torch.cuda.current_device()))
        return found

    def names(self) -> List[str]:
        return [d.short_name for d in self.devices]

    def types(self) -> List[str]:
        """The device types of this task, in table order (CPU first)."""
        return list(dict.fromkeys(d.device_type for d in self.devices))

    def absence(self, device_type: str, index: int) -> str:
        """Why /device:<type>:<index> is not here, for errors and soft-placement logs: a type this task
        lacks altogether (a plug-in's, a typo) is named as such, with the types it has."""
        wanted = f"this task has no /device:{device_type}:{index}"
        devices = ", ".join(self.names())
        if device_type in self.types():
            return f"{wanted} (devices: {devices})"
        close = did_you_mean(device_type, self.types()).strip()
        return (f"{wanted}: it has no device of type {device_type!r} (device types: {', '.join(self.types())}; "
                f"devices: {devices}){' ' + close if close else ''}")


def _split(physical: List[_physical.PhysicalDevice], splits: Dict[str, list]) -> List[LogicalDevice]:
    task = local_task().to_string()
    out: List[LogicalDevice] = []
    counters: Dict[str, int] = {}
    known = {f"{p.device_type}:{p.index}" for p in physical}
    for key in splits:
        if key not in known:
            raise ConfigError(
                f"logical_devices names {key!r}, which this task does not have; physical devices: {', '.join(sorted(known))}"
            )
    for p in physical:
        limits = splits.get(f"{p.device_type}:{p.index}", [None])
        for limit in limits:
            i = counters.get(p.device_type, 0)
            counters[p.device_type] = i + 1
            out.append(
                LogicalDevice(
                    name=f"{task}/device:{p.device_type}:{i}",
                    device_type=p.device_type,
                    index=i,
                    torch_device=torch.device(p.torch_device),
                    physical=p,
                    memory_limit_bytes=limit << 20 if limit else None,
                    is_split=len(limits) > 1,
                )
            )
    return out


_lock = threading.Lock()
_table: Optional[DeviceTable] = None
_in_use = False  # set once a split device has been placed on; TF then refuses to re-split
_local: Optional[DeviceSpec] = None  # the task a started Server made this process (set_local_task)


_building = threading.local()


def building() -> bool:
    """Whether this thread is making the device table now: the torch calls it makes (`torch.device`) are its own,
    for the placement mode to run as they are, not to place or log (that would ask for the table being made)."""
    return getattr(_building, "active", False)


def table() -> DeviceTable:
    global _table
    found = _table
    if found is not None:
        return found
    with _lock:
        if _table is None:
            _building.active = True
            try:
                _table = DeviceTable(_split(_physical.discover(), _config.current().logical_devices or {}))
            finally:
                _building.active = False
        return _table


def mark_split_in_use() -> None:
    global _in_use
    _in_use = True


def _check(old: _config.Config, new: _config.Config) -> None:
    if old.logical_devices != new.logical_devices and _in_use:
        raise ConfigError(
            f"logical_devices={new.logical_devices!r} cannot take effect: tensors were already placed on the "
            f"logical devices {old.logical_devices!r}. Configure logical devices once, before placing anything "
            "(TF raises 'Virtual devices cannot be modified after being initialized' here too)."
        )
    if new.logical_devices and new.logical_devices != old.logical_devices:
        _split(_physical_for_check(new), new.logical_devices)  # unknown physical devices fail now, not later


def _physical_for_check(new: _config.Config) -> List[_physical.PhysicalDevice]:
    gpus = _physical.gpu_count() if new.visible_devices is None else len(new.visible_devices)
    fake = [_physical.PhysicalDevice("GPU", i, f"cuda:{i}", "gpu") for i in range(gpus)]
    return [_physical.PhysicalDevice("CPU", 0, "cpu", "cpu"), *fake]


def _apply(old: _config.Config, new: _config.Config) -> None:
    global _table
    with _lock:
        _table = None


_config.on_change(check=_check, apply=_apply)


def list_devices() -> List[LogicalDevice]:
    """The devices of this task that ops can be placed on, like `tf.config.list_logical_devices()`."""
    return list(table().devices)


def gpu_device_name() -> str:
    """`tf.test.gpu_device_name()`: '/device:GPU:0' when a GPU is present, else ''."""
    return "/device:GPU:0" if table().has_type("GPU") else ""


def is_gpu_available() -> bool:
    """`tf.test.is_gpu_available()`."""
    return table().has_type("GPU")


def device_mapping() -> str:
    """TF's 'Device mapping:' block, one line per device."""
    lines = ["Device mapping:"]
    lines += [f"{d.name} -> {d.describe()}" for d in table().devices]
    return "\n".join(lines)
