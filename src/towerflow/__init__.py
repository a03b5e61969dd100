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
from towerflow.errors import (
    ClusterError,
    ClusterJoinError,
    ClusterSpecError,
    ClusterTimeoutError,
    LaunchError,
    PeerLostError,
    RemoteError,
)
from towerflow.errors import ConfigError, DataError, DeviceSpecError, PlacementError, StrategyError, TowerflowError
from towerflow.cluster import ClusterSpec, RemoteFuture, Server, function, remote
from towerflow.placement import OpInfo, PlacementLog, PlacementRecord, device, placement_log
from towerflow.strategies import (
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    Strategy,
    strategy_from_env,
)
from towerflow.session import CheckpointManager, MonitoredTrainingSession, SessionHook, StopAtStepHook
from towerflow.errors import LayoutError, ParameterServerError
from towerflow.ps import Layout, plan_layout
from towerflow.strategies.parameter_server import ParameterServerStrategy
from towerflow.training import Progress, evaluate, set_seed, train_step

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "MonitoredTrainingSession",
    "SessionHook",
    "StopAtStepHook",
    "ClusterError",
    "ClusterJoinError",
    "ClusterSpec",
    "ClusterSpecError",
    "ClusterTimeoutError",
    "LaunchError",
    "PeerLostError",
    "RemoteError",
    "RemoteFuture",
    "Server",
    "function",
    "remote",
    "train_step",
    "strategy_from_env",
    "set_seed",
    "evaluate",
    "StrategyError",
    "Strategy",
    "Progress",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "ParameterServerError",
    "LayoutError",
    "Layout",
    "plan_layout",
    "MultiWorkerMirroredStrategy",
    "MirroredStrategy",
    "DataError",
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
