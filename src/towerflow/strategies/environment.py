"""What the launcher told this process (docs/architecture.md, "The environment contract"), and
the strategy that follows from it.

`strategy_from_env()` is the one call a script makes to run unchanged under `python script.py`
(one device) and `towerflow launch --workers N script.py` (one replica per worker).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Dict, List, Optional

from towerflow.errors import StrategyError, did_you_mean

ENV_STRATEGY = "TOWERFLOW_STRATEGY"  # optional override: a name in STRATEGIES
ENV_DEVICE = "TOWERFLOW_DEVICE"


@dataclasses.dataclass(frozen=True)
class ReplicaEnv:
    """This process's place in the replica process group, from torchrun's variables and TF_CONFIG."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    assigned_device: Optional[str] = None
    cluster: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
    task_type: Optional[str] = None
    task_index: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_multi_host(self) -> bool:
        hosts = {a.rsplit(":", 1)[0] for job, addrs in self.cluster.items() if job != "ps" for a in addrs}
        return len(hosts) > 1 or self.world_size > self.local_world_size

    @property
    def has_ps(self) -> bool:
        return bool(self.cluster.get("ps"))


def _int(env: Dict[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise StrategyError(f"{name}={text!r} in the environment: expected an integer (set by the launcher)") from None
    if value < 0:
        raise StrategyError(f"{name}={value!r} in the environment: expected a non-negative integer")
    return value


def read_env(env: Optional[Dict[str, str]] = None) -> ReplicaEnv:
    """Parse RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / TOWERFLOW_DEVICE / TF_CONFIG."""
    env = dict(os.environ if env is None else env)
    cluster: Dict[str, List[str]] = {}
    task_type, task_index = None, 0
    if env.get("TF_CONFIG"):
        try:
            tf_config = json.loads(env["TF_CONFIG"])
            cluster = {k: list(v) for k, v in tf_config.get("cluster", {}).items()}
            task = tf_config.get("task", {})
            task_type, task_index = task.get("type"), int(task.get("index", 0))
        except (ValueError, TypeError, AttributeError) as e:
            raise StrategyError(f"TF_CONFIG={env['TF_CONFIG']!r} is not TF's JSON cluster description: {e}") from e
    world = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "RANK", 0)
    if rank >= world:
        raise StrategyError(f"RANK={rank} with WORLD_SIZE={world}: expected RANK < WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", 0)
    if not local_world:  # not in the contract; derive it: same-host peers in TF_CONFIG, else one host
        replicas = [a for job in ("chief", "worker") for a in cluster.get(job, [])]
        here = replicas[rank].rsplit(":", 1)[0] if rank < len(replicas) and len(replicas) == world else None
        local_world = sum(a.rsplit(":", 1)[0] == here for a in replicas) if here else world
    return ReplicaEnv(
        rank=rank,
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", rank if local_world == world else 0),
        local_world_size=local_world,
        assigned_device=env.get(ENV_DEVICE) or None,
        cluster=cluster,
        task_type=task_type,
        task_index=task_index,
    )


def _registry() -> Dict[str, Callable]:
    from towerflow.strategies.mirrored import MirroredStrategy
    from towerflow.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
    from towerflow.strategies.one_device import OneDeviceStrategy

    builtin = {s.name: s for s in (OneDeviceStrategy, MirroredStrategy, MultiWorkerMirroredStrategy)}
    return {**builtin, **_registered}


_registered: Dict[str, Callable] = {}


def register_strategy(cls):
    """Make a Strategy subclass selectable by its `name` (strategy_from_env, $TOWERFLOW_STRATEGY).

    A class named "parameter_server" is also what a cluster with a `ps` job selects by default.
    """
    _registered[cls.name] = cls
    return cls


def choose_strategy(env: ReplicaEnv, name: Optional[str], strategies) -> str:
    """The registry name of the strategy for `env` (`name`, when given, is checked and wins)."""
    if name is None:
        if env.has_ps and "parameter_server" in strategies:
            return "parameter_server"
        if env.has_ps:
            raise StrategyError(
                f"TF_CONFIG has a 'ps' job ({env.cluster['ps']}), but no parameter-server strategy is available yet; "
                "launch without --ps to train with all-reduce"
            )
        if not env.is_distributed:
            return "one_device"
        return "multi_worker_mirrored" if env.is_multi_host or env.cluster else "mirrored"
    if name not in strategies:
        raise StrategyError(
            f"strategy {name!r} is unknown; available: {sorted(strategies)}{did_you_mean(name, strategies)}"
        )
    return name


def strategy_from_env(name: Optional[str] = None, **options):
    """The strategy the launcher set this process up for; `options` go to its constructor.

    No RANK/WORLD_SIZE (plain `python script.py`) or a world of one: `OneDeviceStrategy`.
    A replica group on one host: `MirroredStrategy`; across hosts (or under TF_CONFIG with
    workers): `MultiWorkerMirroredStrategy`. `name` or $TOWERFLOW_STRATEGY forces one.
    """
    strategies = _registry()
    env = read_env()
    name = choose_strategy(env, name or os.environ.get(ENV_STRATEGY) or None, strategies)
    if name == "one_device" and env.assigned_device and "device" not in options:
        options["device"] = env.assigned_device
    return strategies[name](**options)
