"""Devices: TF device names, the hardware present, and the logical devices placed on."""

from towerflow.devices.logical import (
    LogicalDevice,
    device_mapping,
    gpu_device_name,
    is_gpu_available,
    list_devices,
    local_task,
)
from towerflow.devices.spec import DeviceSpec
from towerflow.devices import gpu_memory as _gpu_memory  # noqa: F401  (registers the GPU options)

__all__ = ["DeviceSpec", "LogicalDevice", "list_devices", "device_mapping", "gpu_device_name", "is_gpu_available", "local_task"]
