"""The task environment contract: one reader (`towerflow.taskenv`), one writer (the launcher)."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from towerflow import taskenv
from towerflow.launch.environment import task_environment
from towerflow.cluster.spec import ClusterSpec

DOCS = pathlib.Path(taskenv.__file__).parent.parent.parent / "docs" / "architecture.md"


def test_a_server_s_task_names_this_process_s_devices_from_then_on_and_is_not_written_back(monkeypatch):
    import os

    from towerflow.devices import logical

    monkeypatch.setenv("TOWERFLOW_JOB_NAME", "worker")
    monkeypatch.setenv("TOWERFLOW_TASK_INDEX", "2")
    assert logical.local_task().to_string() == "/job:worker/replica:0/task:2"
    logical.set_local_task("ps", 1)  # what a Server does when it starts
    assert logical.local_task().to_string() == "/job:ps/replica:0/task:1"
    assert (os.environ["TOWERFLOW_JOB_NAME"], os.environ["TOWERFLOW_TASK_INDEX"]) == ("worker", "2")
    assert taskenv.from_environment().identity.job_name == "worker"  # what the launcher said stays as it said


def test_what_the_launcher_writes_reads_back_as_one_task_env():
    cluster = ClusterSpec({"chief": ["h:1"], "worker": ["h:2", "g:3"], "ps": ["h:4"]})
    env = task_environment(cluster, "worker", 0, master_addr="h", master_port=9, logdir="/l", device="/device:CPU:0",
                           token="t", store="h:7", inherited={})
    task = taskenv.read(env)
    assert (task.identity.job_name, task.identity.task_index, task.identity.rank, task.identity.world_size, task.identity.local_rank, task.identity.local_world_size) == (
        "worker", 0, 1, 3, 1, 2)
    assert (task.identity.master_addr, task.identity.master_port, task.tuning.logdir, task.identity.device, task.join.token, task.join.store) == (
        "h", 9, "/l", "/device:CPU:0", "t", "h:7")
    assert {k: list(v) for k, v in task.identity.cluster.items()} == cluster.as_dict()
    assert not task.is_chief and taskenv.read({**env, "TOWERFLOW_JOB_NAME": "chief"}).is_chief
    ps = taskenv.read(task_environment(cluster, "ps", 0, master_addr="h", master_port=9, inherited={}))
    assert (ps.identity.job_name, ps.identity.rank) == ("ps", None)


def test_a_plain_process_gets_the_defaults():
    task = taskenv.read({})
    assert (task.has_task, task.is_chief, task.join.join_timeout, task.join.heartbeat_timeout, task.join.wire_security) == (
        False, True, 60.0, 15.0, None)
    assert (task.identity.restart_count, task.join.max_restarts, task.identity.cluster, task.tuning.threads_set_by_user) == (0, 0, {}, False)
    assert task.ps.promote_after == 5.0  # a lost primary's restart is awaited that long before its backup serves


@pytest.mark.parametrize("tf_config", ["", "{}", '{"task": {}}'])
def test_an_empty_tf_config_is_no_cluster_as_in_tensorflow(tf_config):
    assert taskenv.read({"TF_CONFIG": tf_config}).identity.cluster == {}


def test_the_chief_rule_is_tensorflows():
    assert taskenv.is_chief_task("chief", 0, ["chief", "worker"])
    assert taskenv.is_chief_task("worker", 0, ["worker", "ps"])
    assert not taskenv.is_chief_task("worker", 0, ["chief", "worker"])
    assert not taskenv.is_chief_task("ps", 0, ["worker", "ps"])
    assert not taskenv.is_chief_task("worker", 1, ["worker"])


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("WORLD_SIZE", "0", "WORLD_SIZE='0' in the environment: expected a positive integer"),
        ("RANK", "x", "RANK='x' in the environment: expected a non-negative integer"),
        ("TOWERFLOW_TASK_INDEX", "-2", "TOWERFLOW_TASK_INDEX='-2'"),
        ("MASTER_PORT", "70000", "MASTER_PORT=70000: expected a port between 1 and 65535"),
        ("TOWERFLOW_JOIN_TIMEOUT", "soon", "TOWERFLOW_JOIN_TIMEOUT='soon': expected a positive number of seconds"),
        ("TOWERFLOW_HEARTBEAT_TIMEOUT", "0", "TOWERFLOW_HEARTBEAT_TIMEOUT='0'"),
        ("TOWERFLOW_PS_PROMOTE_AFTER", "-1", "TOWERFLOW_PS_PROMOTE_AFTER='-1': expected a positive number of seconds"),
        ("TOWERFLOW_WIRE_SECURITY", "none", "TOWERFLOW_WIRE_SECURITY='none': expected one of encrypt, authenticate"),
        ("TOWERFLOW_PS_MODE", "eventual", "TOWERFLOW_PS_MODE='eventual': expected one of async, sync, ssp"),
        ("TOWERFLOW_PS_LINK", "tcp", "TOWERFLOW_PS_LINK='tcp': expected one of shm, zmq"),
        ("TOWERFLOW_PS_REPLICAS_TO_AGGREGATE", "0", "TOWERFLOW_PS_REPLICAS_TO_AGGREGATE='0'"),
        ("TOWERFLOW_RESTARTED_AT", "yesterday", "TOWERFLOW_RESTARTED_AT='yesterday'"),
        ("TF_CONFIG", "{nope", "TF_CONFIG is not valid JSON"),
        ("TF_CONFIG", json.dumps({"cluster": ["h:1"]}), 'TF_CONFIG has no "cluster" dict'),
        ("TF_CONFIG", json.dumps({"cluster": {}, "task": {"type": "worker", "index": "one"}}), "task index 'one'"),
    ],
)
def test_a_bad_value_names_the_variable_the_value_and_what_was_expected(name, value, message):
    with pytest.raises(taskenv.TaskEnvironmentError, match=re.escape(message)):
        taskenv.read({name: value})


def test_rank_must_be_below_world_size():
    with pytest.raises(taskenv.TaskEnvironmentError, match="RANK=2 with WORLD_SIZE=2: expected RANK < WORLD_SIZE"):
        taskenv.read({"RANK": "2", "WORLD_SIZE": "2"})


def test_every_variable_of_the_contract_is_in_the_architecture_table():
    table = DOCS.read_text()
    names = [v for k, v in vars(taskenv).items() if k.startswith("ENV_") and isinstance(v, str)]
    missing = [n for n in names if f"`{n}`" not in table]
    assert not missing, f"docs/architecture.md's environment table lacks {missing}"


def test_a_task_without_a_cluster_is_not_distributed_as_in_tensorflow():
    task = taskenv.read({"TF_CONFIG": json.dumps({"task": {"type": "worker", "index": 1}})})
    assert (task.identity.cluster, task.has_task) == ({}, False)


def test_the_scheduler_variables_are_captured_for_the_resolvers():
    env = {"SLURM_PROCID": "1", "OMPI_COMM_WORLD_RANK": "0", "PMI_RANK": "0", "PMIX_RANK": "0", "PET_NNODES": "2",
           "TORCHELASTIC_RUN_ID": "r", "GROUP_RANK": "0", "ROLE_RANK": "1", "KUBERNETES_SERVICE_HOST": "10.0.0.1",
           "TOWERFLOW_SCHEDULER": "slurm", "TOWERFLOW_PS_TASKS": "1", "TOWERFLOW_CHIEF": "1", "TOWERFLOW_EVALUATOR": "0",
           "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "HOME": "/root", "SLURMX": "no"}
    captured = taskenv.read(env).scheduler_env
    assert set(captured) == set(env) - {"HOME", "SLURMX"} and list(captured) == sorted(captured)


def test_placing_ops_does_not_read_the_environment_again_for_each_op(monkeypatch):
    import torch

    import towerflow
    from towerflow.devices import logical

    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}}))
    reads = []
    real_read = taskenv.read
    monkeypatch.setattr(taskenv, "read", lambda env: reads.append(1) or real_read(env))
    with towerflow.device("/cpu:0"):
        torch.ones(2) + 1
    first = len(reads)
    for _ in range(20):
        with towerflow.device("/cpu:0"):
            torch.ones(2) + 1
    assert logical.local_task().to_string() == "/job:worker/replica:0/task:1"
    assert len(reads) == first + 1  # the placements were cached: only the local_task() asked above read it


def test_a_script_may_set_tf_config_itself_before_it_starts_its_task(monkeypatch):
    """As in TensorFlow's guides: import, set TF_CONFIG, then build the strategy or the server."""
    import os

    import towerflow
    from towerflow.strategies.replica_env import read_env

    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert not taskenv.from_environment().identity.cluster  # something asked before the script set it
    monkeypatch.setitem(os.environ, "TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1"], "ps": ["b:2"]},
                                                             "task": {"type": "worker", "index": 0}}))
    assert towerflow.ClusterSpec.from_tf_config().as_dict() == {"worker": ["a:1"], "ps": ["b:2"]}
    assert read_env(taskenv.from_environment()).has_ps  # what strategy_from_env() reads when it is called


def test_no_module_keeps_a_task_context_of_its_own(monkeypatch):
    """The context is built by an entry point and passed down: after a strategy, a session, placements and
    diagnostics have run, no module of towerflow holds one (a changed environment is never shadowed)."""
    import sys

    import torch

    import towerflow
    from towerflow import _log

    monkeypatch.setenv("TOWERFLOW_LOGDIR", "")
    strategy = towerflow.strategy_from_env()
    model, optimizer = strategy.setup(torch.nn.Linear(2, 1), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    with towerflow.device("/cpu:0"):
        model(torch.ones(1, 2))
    _log.get("test").info("said")

    def holds_context(value, depth=0):
        if isinstance(value, taskenv.TaskContext):
            return True
        if depth < 2 and isinstance(value, (list, tuple, set, frozenset)):
            return any(holds_context(v, depth + 1) for v in value)
        if depth < 2 and isinstance(value, dict):
            return any(holds_context(v, depth + 1) for v in value.values())
        return False

    keeping = [f"{name}.{attr}" for name, module in list(sys.modules.items()) if name.startswith("towerflow")
               for attr, value in list(vars(module).items()) if holds_context(value)]
    assert strategy.context.identity.job_name is None and keeping == []


def test_a_launched_task_parses_its_environment_once(monkeypatch):
    """strategy_from_env() reads it; the strategy, its devices, the placements, the session and the diagnostics
    are handed what it read."""
    import torch

    import towerflow
    from towerflow import _log

    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 0}}))
    reads = []
    real_read = taskenv.from_environment
    monkeypatch.setattr(taskenv, "from_environment", lambda: reads.append(1) or real_read())
    strategy = towerflow.strategy_from_env()
    model, optimizer = strategy.setup(torch.nn.Linear(2, 1), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    with towerflow.MonitoredTrainingSession(model, optimizer, strategy=strategy, progress=False,
                                            hooks=[towerflow.StopAtStepHook(last_step=3)]) as session:
        while not session.should_stop():
            with towerflow.device("/job:worker/task:0/cpu:0"):
                session.run(lambda: model(torch.ones(4, 2)).sum())
    _log.get("test").info("said")
    assert strategy.context.identity.job_name == "worker" and len(reads) == 1
