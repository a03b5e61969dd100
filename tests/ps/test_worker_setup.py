"""The worker's side before any call: the strategy refuses a ps task and bad settings with clear
messages, the policy travels as a `PolicySpec` the ps builds, and the launcher has ps tasks serve."""

from __future__ import annotations

import os
import pickle
import sys

import pytest

import towerflow
from towerflow.cluster.calls import wire
from towerflow.errors import ParameterServerError, StrategyError
from towerflow.launch.local import PS_SERVE_MODULE, plan_local
from towerflow.ps.messages import Endpoint, Endpoints, PolicySpec
from towerflow.ps.policies import SSPPolicy, SyncPolicy, make_policy

CLUSTER = {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}


def _server(job: str, index: int):
    return towerflow.Server(CLUSTER, job, index, start=False)


def test_a_ps_task_builds_no_strategy_and_is_told_how_to_serve():
    with pytest.raises(StrategyError, match=r"/job:ps/task:0 is a ps task.*towerflow\.ps\.serve.*\.join\(\)"):
        towerflow.ParameterServerStrategy(server=_server("ps", 0))


@pytest.mark.parametrize("options, message", [
    (dict(mode="synch"), r"mode='synch': expected one of \('async', 'sync', 'ssp'\)"),
    (dict(mode="sync", replicas_to_aggregate=3), r"replicas_to_aggregate=3 with total_replicas=2"),
    (dict(mode="sync", prefetch=True), r"prefetch=True with mode='sync'"),
    (dict(mode="sync", staleness_aware_lr=True), r"staleness_aware_lr has no effect in mode='sync'"),
])
def test_bad_settings_fail_on_the_worker_at_construction(monkeypatch, options, message):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # keep this process's thread count
    with pytest.raises(ParameterServerError, match=message):
        towerflow.ParameterServerStrategy(server=_server("worker", 0), device="cpu", **options)


def test_the_policy_travels_as_a_description_and_the_ps_builds_it():
    spec = PolicySpec("sync", num_workers=3, replicas_to_aggregate=2)
    policy = make_policy(pickle.loads(pickle.dumps(spec)))
    assert isinstance(policy, SyncPolicy) and policy.aggregates and policy.describe() == "sync (2 of 3 replicas per update)"
    ssp = make_policy(PolicySpec("ssp", num_workers=2, staleness=1))
    assert isinstance(ssp, SSPPolicy) and not ssp.aggregates


def test_every_call_a_worker_names_arrives_as_the_ps_function_of_that_name():
    from towerflow.ps.server import endpoints

    named = {name: e for name, e in vars(Endpoints).items() if isinstance(e, Endpoint)}
    assert "push_pull" in named and len(named) > 10
    for name, endpoint in named.items():
        assert endpoint.name == name and pickle.loads(pickle.dumps(endpoint)) is endpoints.endpoint(name)
        method = getattr(endpoints.ServedModels, name)
        assert endpoints.endpoint(name).__wrapped__ is method  # run on this task's ServedModels, marked as it is
        assert getattr(endpoints.endpoint(name), wire.ANSWERS_LATER, False) == getattr(method, wire.ANSWERS_LATER, False)
    assert getattr(endpoints.endpoint("pull"), wire.ANSWERS_LATER)


def test_the_strategy_keeps_the_mode_it_was_given(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    strategy = towerflow.ParameterServerStrategy(server=_server("worker", 1), device="cpu", mode="ssp", staleness=2)
    assert (strategy.mode, strategy.replica_id, strategy.num_ps, strategy.global_step) == ("ssp", 1, 1, 0)
    assert strategy.policy == PolicySpec("ssp", 2, None, 2) and "staleness bound 2" in repr(strategy)


def test_the_launcher_has_ps_tasks_serve_unless_told_to_run_the_script_there():
    script = [sys.executable, "train.py"]
    plan = plan_local(script, ps=1, workers=2)
    argv = {(t.job, t.index): t.argv for t in plan.tasks}
    # the script's folder on the ps's import path, as `python train.py` would have it
    assert argv[("ps", 0)] == [sys.executable, "-m", PS_SERVE_MODULE, "--import-path", os.getcwd()]
    assert argv[("worker", 0)] == argv[("worker", 1)] == script
    # the launcher stops a ps that only serves once every worker has exited 0; a script's own ps runs to its end
    assert [(t.job, t.serves_only) for t in plan.tasks] == [("worker", False), ("worker", False), ("ps", True)]
    plan = plan_local(script, ps=1, workers=1, ps_argv=script)
    assert all(t.argv == script and not t.serves_only for t in plan.tasks)
