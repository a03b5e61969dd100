"""Which strategy the launcher's environment selects, and how that environment is read."""

import json

import pytest

import towerflow
from towerflow import taskenv
from towerflow.errors import StrategyError
from towerflow.strategies.environment import _registry, choose_strategy, read_env

NAMES = _registry()


def _choose(env, name=None):
    return choose_strategy(read_env(taskenv.read(env)), name, NAMES)


def test_plain_process_is_one_device():
    assert _choose({}) == "one_device"
    assert _choose({"RANK": "0", "WORLD_SIZE": "1"}) == "one_device"
    assert isinstance(towerflow.strategy_from_env(), towerflow.OneDeviceStrategy)


def test_replicas_on_one_host_are_mirrored_and_across_hosts_multi_worker():
    assert _choose({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == "mirrored"
    assert _choose({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == "multi_worker_mirrored"
    tf_config = json.dumps({"cluster": {"worker": ["localhost:2222", "localhost:2223"]}, "task": {"type": "worker", "index": 1}})
    env = read_env(taskenv.read({"RANK": "1", "WORLD_SIZE": "2", "TF_CONFIG": tf_config}))
    assert (env.task_type, env.task_index, env.local_world_size, env.local_rank) == ("worker", 1, 2, 1)
    assert choose_strategy(env, None, NAMES) == "multi_worker_mirrored"


def test_tf_config_hosts_give_the_local_replica_count():
    tf_config = json.dumps({"cluster": {"chief": ["a:1"], "worker": ["a:2", "b:1"]}, "task": {"type": "worker", "index": 1}})
    env = read_env(taskenv.read({"RANK": "2", "WORLD_SIZE": "3", "TF_CONFIG": tf_config}))
    assert env.local_world_size == 1 and env.is_multi_host


def test_a_ps_job_selects_the_registered_parameter_server_strategy():
    tf_config = json.dumps({"cluster": {"ps": ["a:1"], "worker": ["a:2"]}, "task": {"type": "worker", "index": 0}})
    env = read_env(taskenv.read({"TF_CONFIG": tf_config}))
    builtin = {k: v for k, v in NAMES.items() if k != "parameter_server"}
    with pytest.raises(StrategyError, match="parameter-server"):
        choose_strategy(env, None, builtin)
    assert choose_strategy(env, None, {**builtin, "parameter_server": object}) == "parameter_server"


def test_unknown_names_and_bad_values_say_what_to_do():
    with pytest.raises(StrategyError, match="Did you mean 'mirrored'"):
        _choose({}, "mirored")
    with pytest.raises(StrategyError, match="WORLD_SIZE='two'"):
        read_env(taskenv.read({"WORLD_SIZE": "two"}))
    with pytest.raises(StrategyError, match="RANK < WORLD_SIZE"):
        read_env(taskenv.read({"RANK": "2", "WORLD_SIZE": "2"}))
    with pytest.raises(StrategyError, match="TF_CONFIG"):
        read_env(taskenv.read({"TF_CONFIG": "{nope"}))


def test_env_override_and_assigned_device(monkeypatch):
    monkeypatch.setenv("TOWERFLOW_STRATEGY", "mirrored")
    assert isinstance(towerflow.strategy_from_env(), towerflow.MirroredStrategy)  # a world of one: no group
    monkeypatch.delenv("TOWERFLOW_STRATEGY")
    monkeypatch.setenv("TOWERFLOW_DEVICE", "/cpu:0")
    assert towerflow.strategy_from_env().device.type == "cpu"


def test_bad_devices_and_options_are_refused():
    with pytest.raises(StrategyError, match="no /device:GPU:7"):
        towerflow.OneDeviceStrategy("/gpu:7")
    with pytest.raises(StrategyError, match="variables_on='gpu'"):
        towerflow.OneDeviceStrategy(variables_on="gpu")
    with pytest.raises(StrategyError, match="mixed_precision='fp8'"):
        towerflow.OneDeviceStrategy(mixed_precision="fp8")
    with pytest.raises(StrategyError, match="exactly one"):
        towerflow.OneDeviceStrategy().distribute_loader([1, 2], batch_size=1, global_batch_size=2)


def test_a_cluster_whose_jobs_name_no_training_part_is_refused_not_trained_alone():
    """Vertex AI's cluster spec names its pools workerpool0, workerpool1, ...: each task used to train alone."""
    env = {"TF_CONFIG": json.dumps({"cluster": {"workerpool0": ["h0:2222"], "workerpool1": ["h1:2222", "h2:2222"]},
                                    "task": {"type": "workerpool1", "index": 1}})}
    with pytest.raises(StrategyError, match=r"/job:workerpool1/task:1 of a cluster with the jobs workerpool0 \(1 task\), "
                                            r"workerpool1 \(2 tasks\).*workerpool0 is the chief"):
        _choose(env)
    assert _choose(env, "one_device") == "one_device"  # asked for by name: this task trains on its own
