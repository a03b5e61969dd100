"""Training strategies: one per file, all behind the `Strategy` contract in `base.py`."""

from towerflow.strategies._optimizer import SyncOptimizer
from towerflow.strategies.base import Strategy
from towerflow.strategies.environment import ReplicaEnv, read_env, register_strategy, strategy_from_env
from towerflow.strategies.mirrored import MirroredStrategy
from towerflow.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from towerflow.strategies.one_device import OneDeviceStrategy
from towerflow.strategies.towers_strategy import TowersStrategy

__all__ = [
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ReplicaEnv",
    "Strategy",
    "SyncOptimizer",
    "TowersStrategy",
    "read_env",
    "register_strategy",
    "strategy_from_env",
]
