"""The task environment: what the launcher writes is what a task reads back."""

from __future__ import annotations

import dataclasses

import json

import pytest

from towerflow import ClusterSpec, ClusterSpecError
from towerflow import taskenv
from towerflow.cluster.environment import read_task
from towerflow.launch.environment import task_environment

CLUSTER = ClusterSpec({"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]})


def env_for(job, index, **kw):
    return task_environment(CLUSTER, job, index, master_addr="h", master_port=9, **kw)


def test_replicas_are_chief_then_workers_and_ps_has_no_rank():
    assert [(env_for(j, i).get("RANK"), env_for(j, i)["WORLD_SIZE"]) for j, i in [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]] == [
        ("0", "3"), ("1", "3"), ("2", "3"), (None, "3")
    ]
    assert "LOCAL_RANK" not in env_for("ps", 0)


def test_local_rank_counts_the_replicas_on_the_same_host():
    cluster = ClusterSpec({"chief": ["a:1"], "worker": ["a:2", "b:1", "localhost:3", "127.0.0.1:4"]})
    local = lambda job, i: (lambda e: (e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]))(task_environment(cluster, job, i, master_addr="a", master_port=9))
    assert [local("chief", 0), local("worker", 0), local("worker", 1), local("worker", 2), local("worker", 3)] == [
        ("0", "2"), ("1", "2"), ("0", "1"), ("0", "2"), ("1", "2")
    ]


def test_written_environment_reads_back():
    env = env_for("worker", 1, logdir="/tmp/x", device="/device:CPU:0", token="t")
    assert json.loads(env["TF_CONFIG"]) == {"cluster": CLUSTER.as_dict(), "task": {"type": "worker", "index": 1}}
    assert (env["TOWERFLOW_JOB_NAME"], env["TOWERFLOW_TASK_INDEX"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("worker", "1", "h", "9")
    assert (env["TOWERFLOW_LOGDIR"], env["TOWERFLOW_DEVICE"], env["TOWERFLOW_CLUSTER_TOKEN"]) == ("/tmp/x", "/device:CPU:0", "t")
    info = read_task(argv=[], env=env)
    assert (info.cluster, info.job_name, info.task_index, info.source) == (CLUSTER, "worker", 1, "TF_CONFIG")


def test_clusters_with_ps_tasks_get_allocator_settings_for_receive_buffers_unless_the_launcher_environment_says():
    no_ps = ClusterSpec({"worker": ["h:2", "h:3"]})
    tuned = {"THP_MEM_ALLOC_ENABLE": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_ARENA_MAX": "1",
             "MALLOC_TRIM_THRESHOLD_": "2147483647"}
    for j, i in [("chief", 0), ("worker", 1), ("ps", 0)]:
        env = env_for(j, i, inherited={})
        assert {k: env.get(k) for k in tuned} == tuned
    assert not set(tuned) & set(task_environment(no_ps, "worker", 0, master_addr="h", master_port=9, inherited={}))
    # set in the launcher's environment (which every task inherits): left alone, so THP_MEM_ALLOC_ENABLE=0 turns it off
    env = env_for("ps", 0, inherited={"THP_MEM_ALLOC_ENABLE": "0"})
    assert "THP_MEM_ALLOC_ENABLE" not in env and env["MALLOC_MMAP_MAX_"] == "0"
    # all of them off: the system's allocator as it is
    assert not set(tuned) & set(env_for("ps", 0, inherited={"TOWERFLOW_PS_ALLOCATOR": "system"}))
    with pytest.raises(ClusterSpecError, match="TOWERFLOW_PS_ALLOCATOR='off': expected one of tuned, system"):
        env_for("ps", 0, inherited={"TOWERFLOW_PS_ALLOCATOR": "off"})


def test_flags_win_over_the_environment():
    info = read_task(argv=["--worker_hosts", "h:5,h:6", "--job_name", "worker", "--task_index", "1"], env=env_for("ps", 0))
    assert (info.cluster.as_dict(), info.name, info.source) == ({"worker": ["h:5", "h:6"]}, "/job:worker/task:1", "flags")


def test_the_bare_env_variables_are_read_by_the_schedulers_resolver():
    """RANK/WORLD_SIZE/MASTER_* without torchrun's marks: the `env` resolver, which `towerflow cluster` reads too."""
    info = read_task(argv=[], env={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (info.name, info.source, info.cluster.as_dict()) == (
        "/job:worker/task:1", "env", {"worker": ["127.0.0.1:29501", "127.0.0.1:29502"]})


@pytest.mark.parametrize(
    "argv, env, message",
    [
        ([], {}, "not part of a cluster"),
        (["--worker_hosts", "h:1"], {}, "without --job_name and --task_index"),
        (["--worker_hosts", "h:1", "--job_name", "ps", "--task_index", "0"], {}, "unknown job name 'ps'"),
        (["--worker_hosts", "h:1", "--job_name", "worker", "--task_index", "3"], {}, "task index 3 is out of range"),
        ([], {"TF_CONFIG": json.dumps({"cluster": {"worker": ["h:1"]}})}, "names a cluster but not this task"),
        ([], {"RANK": "-1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='-1'"),
    ],
)
def test_bad_task_environments(argv, env, message):
    with pytest.raises(ClusterSpecError, match=message):
        read_task(argv=argv, env=env)


def test_token_sources(tmp_path, monkeypatch):
    from towerflow import Server

    (tmp_path / "t").write_text("from-file\n")
    (tmp_path / "empty").write_text("")
    monkeypatch.setenv("TOWERFLOW_CLUSTER_TOKEN", "env")
    assert Server({"worker": ["localhost:1"]}, token="explicit", start=False).token == "explicit"
    assert Server({"worker": ["localhost:1"]}, start=False).token == "env"
    assert taskenv.read({"TOWERFLOW_CLUSTER_TOKEN": "env"}).join.cluster_token() == "env"
    assert taskenv.read({"TOWERFLOW_CLUSTER_TOKEN_FILE": str(tmp_path / "t")}).join.cluster_token() == "from-file"
    assert taskenv.read({}).join.cluster_token() is None
    with pytest.raises(ClusterSpecError, match="is empty"):
        taskenv.read({"TOWERFLOW_CLUSTER_TOKEN_FILE": str(tmp_path / "empty")}).join.cluster_token()


def test_wire_security_is_encrypted_across_hosts_authenticated_on_loopback_and_a_bad_name_is_refused(monkeypatch):
    from towerflow import Server
    from towerflow.errors import ConfigError

    monkeypatch.delenv("TOWERFLOW_WIRE_SECURITY", raising=False)
    assert Server({"worker": ["localhost:1"]}, start=False).wire_security.mode == "authenticate"
    server = Server({"worker": ["localhost:1"]}, start=False)
    server.binding = dataclasses.replace(server.binding, multi_host=True)  # as on a cluster of several hosts
    assert server._default_wire_security() == "encrypt"
    monkeypatch.setenv("TOWERFLOW_WIRE_SECURITY", "encrypt")
    assert Server({"worker": ["localhost:1"]}, start=False).wire_security.mode == "encrypt"
    monkeypatch.setenv("TOWERFLOW_WIRE_SECURITY", "plain")
    with pytest.raises(ConfigError, match=r"TOWERFLOW_WIRE_SECURITY='plain': expected one of encrypt, authenticate"):
        Server({"worker": ["localhost:1"]}, start=False)


@pytest.mark.parametrize("tf_config", ["{}", json.dumps({"task": {"type": "worker", "index": 0}})])
def test_a_tf_config_without_a_cluster_is_not_distributed(tf_config):
    with pytest.raises(ClusterSpecError, match="not part of a cluster"):
        read_task(argv=[], env={"TF_CONFIG": tf_config})


def test_a_sparse_tf_config_cluster_is_read():
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": {"1": "h:1", "3": "h:3"}}, "task": {"type": "worker", "index": 3}})}
    info = read_task(argv=[], env=env)
    assert (info.name, info.cluster.task_indices("worker")) == ("/job:worker/task:3", [1, 3])
