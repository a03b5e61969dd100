"""The three entry points read every recorded environment (golden.json) the same way: `towerflow cluster
--json`, `towerflow launch` (its slot under a scheduler) and `strategy_from_env()` place the process at the
same task, rank and world, or all three refuse it with the same message. Nothing joins: where a cluster
must be gathered at runtime, the gathering is replaced by one that names every rank's host in turn, and
this machine plays the slot's host (its name resolves to an address of this machine).

What is compared is the task's identity, (job, index, tasks in the cluster): a replica group kept as
torchrun made it has no job names, and its replica k is worker k of that many. `towerflow launch` is no
entry point for a task TF_CONFIG already placed (it launches one with `--cluster FILE`), so it is left out
of those comparisons."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import pytest

from towerflow import taskenv
from towerflow.cli import main
from towerflow.cluster import addresses
from towerflow.cluster.membership import gather
from towerflow.errors import TowerflowError
from towerflow.launch import planning
from towerflow.launch.config import LaunchConfig
from towerflow.strategies import environment as strategy_environment
from towerflow.strategies.replica_env import read_env

CASES = json.loads((pathlib.Path(__file__).parent / "golden.json").read_text())


def _tasks(cluster, world):
    return sum(len(v) for v in cluster.values()) if cluster else world


def _gathered(resolved, timeout, env=None):
    if resolved.cluster is not None:
        return resolved
    port = resolved.port or 20000
    return dataclasses.replace(resolved, cluster={"worker": [f"host{r}:{port}" for r in range(resolved.world_size)]})


@pytest.fixture
def place(monkeypatch):
    """Set a case's environment (and nothing else a scheduler sets); the three entry points' answers."""
    saved = dict(os.environ)
    for name in [*taskenv.scheduler_variables(os.environ), taskenv.ENV_STRATEGY]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gather, "complete", _gathered)
    monkeypatch.setattr(addresses, "resolve", lambda host, where="": ["10.9.8.7"])
    monkeypatch.setattr(addresses, "local_addresses", lambda: {"10.9.8.7": "eth0"})
    chosen = []
    built = []  # the context each strategy was handed: what it trains as

    def recorder(n):
        def build(context, **options):
            chosen.append(n)
            built.append(context)
        return build
    monkeypatch.setattr(strategy_environment, "_registry", lambda: {n: recorder(n) for n in (
        "one_device", "mirrored", "multi_worker_mirrored", "parameter_server")})
    monkeypatch.setattr(strategy_environment, "_serve_and_exit", lambda task: (chosen.append("serve"), built.append(task)))

    def answers(case, capsys):
        for k, v in case["env"].items():
            monkeypatch.setenv(k, v)
        if case.get("scheduler"):
            monkeypatch.setenv(taskenv.ENV_SCHEDULER, case["scheduler"])
        out = {}
        code = main(["cluster", "--json"])
        said, err = capsys.readouterr()
        out["placed_by_tf_config"] = not code and json.loads(said)["scheduler"] == "tf_config"
        out["cluster"] = err.removeprefix("towerflow cluster: error: ").strip() if code else _of_json(json.loads(said))
        try:
            slot = planning._scheduled_slot(LaunchConfig("train.py"))
            out["launch"] = None if slot is None else (slot.job_name, slot.task_index, _tasks(slot.cluster, slot.world_size))
        except TowerflowError as e:
            out["launch"] = str(e)
        try:
            before = dict(os.environ)
            strategy_environment.strategy_from_env()
            assert dict(os.environ) == before  # the slot's environment is handed down, never written to the process's
            task = built[-1]
            place = read_env(task)
            if task.identity.cluster:
                out["strategy"] = (task.identity.job_name, task.identity.task_index, sum(len(v) for v in task.identity.cluster.values()))
            elif place.world_size > 1:
                out["strategy"] = ("worker", place.rank, place.world_size)
            else:
                out["strategy"] = None
        except TowerflowError as e:
            out["strategy"] = str(e)
        return out

    yield answers
    os.environ.clear()
    os.environ.update(saved)


def _of_json(said):
    if said["scheduler"] is None:
        return None
    task = said["task"] or {}
    return (task.get("type"), task.get("index"), _tasks(said.get("cluster"), said.get("world_size")))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_cluster_launch_and_strategy_from_env_agree(place, capsys, case):
    got = place(case, capsys)
    if got.pop("placed_by_tf_config"):
        got.pop("launch")
        assert got["cluster"] == got["strategy"], got
    else:
        assert got["cluster"] == got["launch"] == got["strategy"], got
