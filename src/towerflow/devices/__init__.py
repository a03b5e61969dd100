"""Devices: TF device names, the hardware present, and the logical devices placed on.

Names are imported on first use (towerflow/_lazy.py): parsing a device name needs no torch.
"""

from typing import TYPE_CHECKING

from towerflow import _lazy

__all__ = ["DeviceSpec", "LogicalDevice", "list_devices", "device_mapping", "gpu_device_name", "is_gpu_available", "local_task"]
__getattr__, __dir__ = _lazy.exports(__name__, {
    **_lazy.names_from("towerflow.devices.logical", [n for n in __all__ if n != "DeviceSpec"]),
    "DeviceSpec": "towerflow.devices.spec",
})

if TYPE_CHECKING:
    from towerflow.devices.logical import (  # noqa: F401
        LogicalDevice,
        device_mapping,
        gpu_device_name,
        is_gpu_available,
        list_devices,
        local_task,
    )
    from towerflow.devices.spec import DeviceSpec  # noqa: F401
