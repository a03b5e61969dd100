"""`towerflow cluster --json` and `strategy_from_env()` read one environment the same way: both recognise a
process's place (the same rank of the same world) or both refuse it with the same message."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from towerflow import taskenv
from towerflow.cli import main
from towerflow.errors import TowerflowError
from towerflow.strategies import environment as strategy_environment
from towerflow.strategies.replica_env import read_env

CASES = {c["name"]: c["env"] for c in json.loads((pathlib.Path(__file__).parent / "golden.json").read_text())}
RAY = CASES["env:// Ray Train worker, two on one node"]
ENVIRONMENTS = {
    "plain process": {},
    "a world of one": {"RANK": "0", "WORLD_SIZE": "1"},
    "a world of one with a rendezvous": {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
    "Ray Train, one node": RAY,
    "Ray Train, two nodes": CASES["env:// Ray Train across two nodes: gathered at MASTER_ADDR"],
    "Azure ML, no LOCAL_WORLD_SIZE": CASES["env:// Azure ML per-process launch without LOCAL_WORLD_SIZE: one host"],
    "no MASTER_ADDR": {"RANK": "1", "WORLD_SIZE": "2"},
    "no RANK": {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
    "a bad MASTER_PORT": {**RAY, "MASTER_PORT": "http"},
    "torchrun, one node": CASES["torchrun one node, 4 processes"],
}


@pytest.fixture
def environ(monkeypatch):
    for name in [*taskenv.scheduler_variables(os.environ), taskenv.ENV_STRATEGY]:
        monkeypatch.delenv(name, raising=False)
    chosen = []

    def recorder(name):
        def build(context, **options):  # what strategy_from_env() would build, and the place it read: nothing joins
            chosen.append((name, read_env(context)))
        return build

    monkeypatch.setattr(strategy_environment, "_registry", lambda: {n: recorder(n) for n in (
        "one_device", "mirrored", "multi_worker_mirrored", "parameter_server")})

    def set_env(values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)
    return set_env, chosen


@pytest.mark.parametrize("name", ENVIRONMENTS)
def test_the_cluster_command_and_strategy_from_env_agree(environ, capsys, name):
    set_env, chosen = environ
    set_env(ENVIRONMENTS[name])
    code = main(["cluster", "--json"])
    out, err = capsys.readouterr()
    try:
        strategy_environment.strategy_from_env()
        refused = None
    except TowerflowError as e:
        refused = str(e)
    if code == 2:
        assert refused is not None and err == f"towerflow cluster: error: {refused}\n"
        return
    assert code == 0 and refused is None
    said = json.loads(out)
    rank, world = (said["rank"], said["world_size"]) if said["scheduler"] else (0, 1)
    (strategy, place), = chosen
    assert (place.rank, place.world_size) == (rank, world)
    assert (strategy != "one_device") == (world > 1)


def test_the_generic_env_contract_is_a_scheduler_to_both(environ, capsys):
    """Ray Train's variables: the command names the `env` scheduler and the strategy joins that same group."""
    set_env, chosen = environ
    set_env(RAY)
    assert main(["cluster", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert (said["scheduler"], said["task"], said["world_size"]) == ("env", {"type": "worker", "index": 1}, 2)
    strategy_environment.strategy_from_env()
    assert chosen[0][0] == "mirrored" and (chosen[0][1].rank, chosen[0][1].world_size) == (1, 2)


def test_a_missing_rendezvous_is_refused_by_both_with_the_fix(environ, capsys):
    set_env, _ = environ
    set_env({"RANK": "1", "WORLD_SIZE": "2"})
    assert main(["cluster"]) == 2
    assert "MASTER_ADDR is not set" in capsys.readouterr().err
    with pytest.raises(TowerflowError, match="MASTER_ADDR is not set: it gives the host of rank 0; torch.distributed's "
                                             "env:// contract needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"):
        strategy_environment.strategy_from_env()
