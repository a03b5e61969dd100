"""Which device a replica computes on, named the TF way."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from towerflow.devices import gpu_memory as _gpu_memory
from towerflow.devices import logical as _logical
from towerflow.devices.spec import DeviceSpec
from towerflow.errors import DeviceSpecError, StrategyError


def resolve_device(spec) -> Tuple[torch.device, str]:
    """(torch device, full TF name) for a TF or torch device string of this task.

    `/cpu:N` with N past the configured CPUs still resolves to the host CPU: that is a logical
    CPU replica device, one per process, all backed by the one physical CPU.
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    try:
        parsed = DeviceSpec.parse(spec)
    except DeviceSpecError as e:
        raise StrategyError(f"device={spec!r} is not a device name: {e}") from e
    table = _logical.table()
    device_type = parsed.device_type or ("GPU" if table.has_type("GPU") else "CPU")
    index = parsed.device_index or 0
    found = table.lookup(device_type, index)
    if found is not None:
        return found.torch_device, found.name
    if device_type == "CPU":
        return torch.device("cpu"), f"{_logical.local_task().to_string()}/device:CPU:{index}"
    raise StrategyError(
        f"device={spec!r}: {table.absence(device_type, index)}. "
        "Name one of them, or check CUDA_VISIBLE_DEVICES / towerflow.configure(visible_devices=...)."
    )


def default_device() -> Tuple[torch.device, str]:
    """The first GPU, else the CPU (TF's default placement)."""
    return resolve_device("/gpu:0" if _logical.table().has_type("GPU") else "/cpu:0")


def replica_device(local_rank: int, local_replicas: int, devices: Optional[Sequence[str]] = None,
                   assigned: Optional[str] = None) -> Tuple[torch.device, str]:
    """The device of local replica `local_rank` of `local_replicas` on this host.

    Order of precedence: the launcher's TOWERFLOW_DEVICE (`assigned`), the strategy's
    `devices` list, then one GPU per local replica, else logical CPU devices (/cpu:0, /cpu:1, ...).
    """
    if assigned:
        return resolve_device(assigned)
    if devices is not None:
        if len(devices) != local_replicas:
            raise StrategyError(
                f"devices={list(devices)!r} names {len(devices)} devices but {local_replicas} replica processes run on "
                "this host: start one process per device (towerflow launch --nproc N) or list one device per process"
            )
        return resolve_device(devices[local_rank])
    gpus = [d for d in _logical.table().devices if d.device_type == "GPU"]
    if gpus:
        return resolve_device(f"/gpu:{local_rank % len(gpus)}")
    return resolve_device(f"/cpu:{local_rank}")


def confine_replica_memory(device_name: str) -> Optional[int]:
    """A replica process on one logical device of a split GPU gets that device's memory limit as its cap."""
    found = next((d for d in _logical.table().devices if d.name == device_name), None)
    return _gpu_memory.confine_to(found) if found is not None else None
