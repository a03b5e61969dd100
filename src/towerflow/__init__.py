"""towerflow: TensorFlow's device placement, clusters and parallel training for PyTorch."""

from towerflow.config import Config, configure
from towerflow.devices import (
    DeviceSpec,
    LogicalDevice,
    device_mapping,
    gpu_device_name,
    is_gpu_available,
    list_devices,
)
from towerflow.errors import ConfigError, DeviceSpecError, PlacementError, TowerflowError
from towerflow.placement import OpInfo, PlacementLog, PlacementRecord, device, placement_log

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "DeviceSpec",
    "DeviceSpecError",
    "LogicalDevice",
    "OpInfo",
    "PlacementError",
    "PlacementLog",
    "PlacementRecord",
    "TowerflowError",
    "configure",
    "device",
    "device_mapping",
    "gpu_device_name",
    "is_gpu_available",
    "list_devices",
    "placement_log",
]
