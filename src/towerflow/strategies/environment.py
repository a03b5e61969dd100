"""What the launcher told this process (docs/architecture.md, "The environment contract"), and
the strategy that follows from it.

`strategy_from_env()` is the one call a script makes to run unchanged under `python script.py`
(one device) and `towerflow launch --workers N script.py` (one replica per worker).
"""

from __future__ import annotations

import inspect
from typing import Callable, Dict, Optional

from towerflow import taskenv as _taskenv
from towerflow.errors import StrategyError, did_you_mean
from towerflow.strategies.replica_env import ReplicaEnv, read_env

__all__ = ["ReplicaEnv", "choose_strategy", "read_env", "register_strategy", "strategy_from_env"]

TRAINING_JOBS = ("chief", "worker", "ps", "evaluator")  # the jobs a strategy knows a task's part from


def _registry() -> Dict[str, Callable]:
    from towerflow.strategies.mirrored import MirroredStrategy
    from towerflow.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
    from towerflow.strategies.one_device import OneDeviceStrategy
    from towerflow.strategies.parameter_server import ParameterServerStrategy

    builtin = {s.name: s for s in (OneDeviceStrategy, MirroredStrategy, MultiWorkerMirroredStrategy,
                                   ParameterServerStrategy)}
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
    if name is None and env.cluster and env.task_type not in TRAINING_JOBS:
        jobs = ", ".join(f"{job} ({len(tasks)} task{'s' * (len(tasks) != 1)})" for job, tasks in env.cluster.items())
        raise StrategyError(
            f"this task is /job:{env.task_type}/task:{env.task_index} of a cluster with the jobs {jobs}, and towerflow "
            f"trains with the jobs {', '.join(TRAINING_JOBS)}: it cannot tell which of these tasks are workers or ps "
            "tasks. Name the jobs so in TF_CONFIG (Vertex AI's workerpool0 is the chief, workerpool1 the workers, "
            "workerpool2 the ps tasks), start the tasks with `towerflow launch`, or pass the strategy's name to "
            "strategy_from_env() to train this task on its own"
        )
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

    Started by a scheduler without the launcher (`srun -n 3 python SCRIPT`, `mpirun ...`), the
    process places itself first: the scheduler's slot (cluster/schedulers, with the roles of
    TOWERFLOW_PS_TASKS / TOWERFLOW_CHIEF / TOWERFLOW_EVALUATOR) becomes the environment
    `towerflow launch` would have given it. torchrun and a PyTorchJob give a replica group of
    their own, kept as it is unless roles are asked for.

    **On a ps task, strategy_from_env() serves until the job ends, then exits the process (status
    0)** — what `towerflow launch` runs on ps tasks (`towerflow.ps.serve`). A ps trains nothing, so
    there is no strategy to return, and the same script runs on every slot of a scheduler's job;
    the ParameterServerStrategy constructor itself never exits (it refuses a ps task), so a script
    that builds it directly keeps the choice of running `Server().join()` there.
    """
    strategies = _registry()
    task = _place_from_scheduler(_taskenv.from_environment())
    if task.identity.job_name == "ps" and task.identity.cluster and (name or task.tuning.strategy or "parameter_server") == "parameter_server":
        _serve_and_exit(task)
    env = read_env(task)
    name = choose_strategy(env, name or task.tuning.strategy, strategies)
    if name == "one_device" and env.assigned_device and "device" not in options:
        options["device"] = env.assigned_device
    chosen = strategies[name]
    if _takes_context(chosen):  # a registered strategy of a user's may read its environment itself
        options.setdefault("context", task)
    return chosen(**options)


def _takes_context(cls) -> bool:
    parameters = inspect.signature(cls.__init__).parameters.values()
    return any(p.name == "context" or p.kind is p.VAR_KEYWORD for p in parameters)


def _place_from_scheduler(task: "_taskenv.TaskContext") -> "_taskenv.TaskContext":
    """This process's task environment, placed from a scheduler's slot when nothing placed it yet."""
    from towerflow.cluster import schedulers
    from towerflow.cluster.environment import scheduled_slot

    if task.identity.cluster:  # TF_CONFIG placed it: checked as `towerflow cluster` checks it (an index out of range, roles)
        schedulers.resolve(task.scheduler_env)
        return task
    named = bool((task.scheduler_env.get(_taskenv.ENV_SCHEDULER) or "").strip())
    own_group = task.identity.world_size is not None and not named  # torchrun's / a PyTorchJob's own replica group ...
    resolved = scheduled_slot(task, check=lambda r: not (  # ... kept as it is unless roles are asked for
        own_group and schedulers.Roles.from_env(task.scheduler_env).is_default))
    if resolved is None:
        return task
    from towerflow.launch import environment as launch_env
    from towerflow.launch.scheduled import NOT_INHERITED, slot_environment

    # the context `towerflow launch` would have given it; its own environment stays as the scheduler set it
    return _taskenv.read({**launch_env.inherited(drop=NOT_INHERITED),
                          **slot_environment(resolved, logdir=task.tuning.logdir)})


def _serve_and_exit(task: "_taskenv.TaskContext") -> None:
    """A ps task: serve its variables until every task is done, then end the process (docstring above)."""
    from towerflow.ps.serve import main

    main([], context=task)
    raise SystemExit(0)
