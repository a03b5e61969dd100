"""towerflow: TensorFlow's device placement, clusters and parallel training for PyTorch.

The public names are imported on first use (towerflow/_lazy.py): `towerflow launch`, `top`,
`report` and `smi` never import torch (about 2 s of CPU per process on a small machine), and a
training script gets every name as before (`towerflow.device`, `from towerflow import MirroredStrategy`).
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any, Optional

from towerflow import _lazy
from towerflow import config as _config
from towerflow.config import Config, ConfigError
from towerflow.errors import (
    ClusterError,
    ClusterJoinError,
    ClusterSpecError,
    ClusterTimeoutError,
    DataError,
    DeviceSpecError,
    LaunchError,
    LayoutError,
    ParameterServerError,
    ConnectionLost,
    PeerLost,
    PSTaskLost,
    PlacementError,
    RemoteError,
    StrategyError,
    TowerflowError,
)

__version__ = "0.1.0"


@functools.wraps(_config.configure)
def configure(config: Optional[Config] = None, **options: Any) -> Config:
    # The layers that check and apply options (devices: GPU memory, visibility, logical devices;
    # placement: the log, soft placement) register when imported: import them before the change.
    importlib.import_module("towerflow.placement")
    importlib.import_module("towerflow.devices.logical")
    return _config.configure(config, **options)


_LAZY = {
    **_lazy.names_from("towerflow.devices.logical", ["LogicalDevice", "device_mapping", "gpu_device_name",
                                                     "is_gpu_available", "list_devices"]),
    "DeviceSpec": "towerflow.devices.spec",
    "ClusterSpec": "towerflow.cluster.spec",
    "cluster_flags": "towerflow.cluster.spec",
    "Server": "towerflow.cluster.server",
    **_lazy.names_from("towerflow.cluster.remote", ["RemoteFuture", "function", "remote"]),
    **_lazy.names_from("towerflow.placement", ["OpInfo", "PlacementLog", "PlacementRecord", "device", "placement_log"]),
    **_lazy.names_from("towerflow.strategies", ["MirroredStrategy", "MultiWorkerMirroredStrategy", "OneDeviceStrategy",
                                                "Strategy", "strategy_from_env"]),
    "ParameterServerStrategy": "towerflow.strategies.parameter_server",
    **_lazy.names_from("towerflow.session", ["CheckpointManager", "MonitoredTrainingSession", "ProfilerHook",
                                             "SessionHook", "StopAtStepHook"]),
    **_lazy.names_from("towerflow.ps", ["Layout", "plan_layout"]),
    **_lazy.names_from("towerflow.training", ["Progress", "evaluate", "set_seed", "train_step"]),
    **_lazy.names_from("towerflow.data.batch_facts", ["BatchFacts", "batch_facts"]),
}
# the subpackages a user reaches through the package's name (`towerflow.ps.SparseAdam`, `towerflow.training.save_metrics`)
_SUBPACKAGES = ("cluster", "data", "devices", "monitoring", "placement", "ps", "session", "strategies", "training")
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, _SUBPACKAGES)

__all__ = [
    "Config", "ConfigError", "configure", "ClusterError", "ClusterJoinError", "ClusterSpecError",
    "ClusterTimeoutError", "DataError", "DeviceSpecError", "LaunchError", "LayoutError", "ParameterServerError",
    "ConnectionLost", "PeerLost", "PSTaskLost", "PlacementError", "RemoteError", "StrategyError", "TowerflowError",
]
__all__ += sorted(_LAZY)

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from towerflow.cluster.remote import RemoteFuture, function, remote  # noqa: F401
    from towerflow.cluster.server import Server  # noqa: F401
    from towerflow.cluster.spec import ClusterSpec  # noqa: F401
    from towerflow.data.batch_facts import BatchFacts, batch_facts  # noqa: F401
    from towerflow.devices.logical import (  # noqa: F401
        LogicalDevice,
        device_mapping,
        gpu_device_name,
        is_gpu_available,
        list_devices,
    )
    from towerflow.devices.spec import DeviceSpec  # noqa: F401
    from towerflow.placement import OpInfo, PlacementLog, PlacementRecord, device, placement_log  # noqa: F401
    from towerflow.ps import Layout, plan_layout  # noqa: F401
    from towerflow.session import (  # noqa: F401
        CheckpointManager,
        MonitoredTrainingSession,
        ProfilerHook,
        SessionHook,
        StopAtStepHook,
    )
    from towerflow.strategies import (  # noqa: F401
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        OneDeviceStrategy,
        Strategy,
        strategy_from_env,
    )
    from towerflow.strategies.parameter_server import ParameterServerStrategy  # noqa: F401
    from towerflow.training import Progress, evaluate, set_seed, train_step  # noqa: F401
