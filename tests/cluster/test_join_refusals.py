"""Every way a task can be refused gives a clear error quickly, never a hang."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

import towerflow
from towerflow.devices.logical import set_local_task
from _cluster_procs import Procs, wait_until

from towerflow.cluster.ports import PortReservation

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

TOKEN = "s3cret-token"


@pytest.fixture(autouse=True)
def task_env(monkeypatch):
    # A Server makes this process its task (environment, device names); undo that after each test.
    for name in ("TOWERFLOW_JOB_NAME", "TOWERFLOW_TASK_INDEX", "TOWERFLOW_CLUSTER_TOKEN", "TOWERFLOW_CLUSTER_TOKEN_FILE", "TP_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    yield
    set_local_task("localhost", 0)  # drops the cached names; monkeypatch then unsets the variables again


@pytest.fixture(scope="module")
def half_cluster(tmp_path_factory):
    """worker 0 (the coordinator) and worker 1 of a 3-task cluster, with a token; worker 2 never comes."""
    procs = Procs(tmp_path_factory.mktemp("half"))
    held = PortReservation(3)
    cluster = {"worker": [f"localhost:{p}" for p in held.ports]}
    env = {"TOWERFLOW_CLUSTER_TOKEN": TOKEN, "TOWERFLOW_JOIN_TIMEOUT": "60"}
    tasks = [procs.python("_cluster_serve.py", json.dumps(cluster), "worker", str(i), env=env, label=f"worker{i}") for i in (0, 1)]
    try:
        wait_until(lambda: "2 of 3 tasks up" in tasks[0].err, 30, "the coordinator to report 2 of 3 tasks up")
        yield cluster, tasks
    except AssertionError:
        print(procs.describe())
        raise
    finally:
        for t in tasks:
            t.kill_group()
        held.release()


def test_the_first_task_up_says_whom_it_waits_for(half_cluster):
    cluster, (w0, _) = half_cluster
    address = cluster["worker"][2]
    assert f"waiting for /job:worker/task:2 at {address} — 2 of 3 tasks up" in w0.err


def test_wrong_token_is_refused(half_cluster, monkeypatch):
    cluster, _ = half_cluster
    monkeypatch.setenv("TOWERFLOW_CLUSTER_TOKEN", "not-the-token")
    with pytest.raises(towerflow.ClusterJoinError, match="wrong cluster token"):
        towerflow.Server(cluster, "worker", 2, join_timeout=10)


def test_missing_token_is_refused(half_cluster):
    cluster, _ = half_cluster
    with pytest.raises(towerflow.ClusterJoinError, match="requires a token and this task has none"):
        towerflow.Server(cluster, "worker", 2, join_timeout=10)


def test_token_from_a_file_is_accepted_up_to_the_spec_check(half_cluster, tmp_path, monkeypatch, free_ports):
    cluster, _ = half_cluster
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv("TOWERFLOW_CLUSTER_TOKEN_FILE", str(tmp_path / "token"))
    other = {**cluster, "ps": [f"localhost:{free_ports(1)[0]}"]}
    with pytest.raises(towerflow.ClusterJoinError, match="different cluster spec") as e:
        towerflow.Server(other, "worker", 2, join_timeout=10)
    assert "'ps'" in str(e.value)  # both specs are shown


def test_a_second_task_for_a_taken_slot_is_refused(half_cluster):
    cluster, (_, w1) = half_cluster
    with pytest.raises(towerflow.ClusterJoinError, match=rf"/job:worker/task:1 is already taken by another process \(pid {w1.popen.pid}"):
        towerflow.Server(cluster, "worker", 1, token=TOKEN, join_timeout=10)


def test_port_in_use_is_refused_at_once():
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(towerflow.ClusterJoinError, match=rf"port {port} of /job:worker/task:0 .* already in use"):
            towerflow.Server({"worker": [f"localhost:{port}"]}, "worker", 0, join_timeout=10)
        assert time.monotonic() - start < 5


def test_timeout_lists_the_missing_tasks(capsys, free_ports):
    ports = free_ports(3)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    with pytest.raises(towerflow.ClusterTimeoutError) as e:
        towerflow.Server(cluster, "worker", 0, join_timeout=2)
    assert e.value.missing == ("/job:worker/task:1", "/job:worker/task:2")
    assert re.search(r"gave up after 2 s with 1 of 3 tasks up; missing: /job:worker/task:1 at localhost:\d+, /job:worker/task:2", str(e.value))
    assert "waiting for /job:worker/task:1" in capsys.readouterr().err


def test_timeout_when_the_coordinator_never_comes(capsys, free_ports):
    ports = free_ports(2)
    cluster = {"ps": [f"localhost:{ports[1]}"], "worker": [f"localhost:{ports[0]}"]}
    with pytest.raises(towerflow.ClusterTimeoutError, match=r"coordinator /job:worker/task:0 .* never came up") as e:
        towerflow.Server(cluster, "ps", 0, join_timeout=2)
    assert e.value.missing == ("/job:worker/task:0",)
    assert f"waiting for /job:worker/task:0 at localhost:{ports[0]} — 1 of 2 tasks up" in capsys.readouterr().err
