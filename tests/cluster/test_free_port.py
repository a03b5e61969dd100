"""Port 0 in a cluster spec ('localhost:0', TF's "any free port"): a one-task cluster's server binds a
free port and reports it; where the port must be known in advance, a refusal that says why and what to do."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import towerflow
from towerflow.devices.logical import set_local_task
from towerflow.errors import LaunchError
from towerflow.launch.local import replica_master

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def task_env(monkeypatch):
    # A Server makes this process its task (environment, device names); undo that after each test.
    for name in ("TOWERFLOW_JOB_NAME", "TOWERFLOW_TASK_INDEX", "TOWERFLOW_CLUSTER_TOKEN", "TOWERFLOW_CLUSTER_TOKEN_FILE",
                 "TOWERFLOW_STORE", "TP_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    yield
    set_local_task("localhost", 0)


def _listens(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    except OSError:
        return False


def test_a_one_task_server_at_port_0_binds_a_free_port_and_reports_it(task_env):
    server = towerflow.Server({"worker": ["localhost:0"]}, "worker", 0, join_timeout=20)
    try:
        host, port = server.address.rsplit(":", 1)
        assert host == "localhost" and int(port) > 0
        assert server.target == f"towerflow://localhost:{port}"  # as TF's server.target shows the bound port
        assert server.binding.port == int(port) and _listens(int(port))
        assert server.cluster.as_dict() == {"worker": ["localhost:0"]}  # the spec as written
    finally:
        server.join(timeout=20)


def test_create_local_server_asks_for_port_0_as_tf_does(task_env):
    server = towerflow.Server.create_local_server(join_timeout=20)
    try:
        assert server.cluster.as_dict() == {"localhost": ["localhost:0"]}
        port = int(server.address.rsplit(":", 1)[1])
        assert port > 0 and server.target == f"towerflow://localhost:{port}" and _listens(port)
    finally:
        server.join(timeout=20)


def test_a_one_task_tf_config_at_port_0_just_works():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERFLOW_", "TF_CONFIG"))}
    env["TF_CONFIG"] = json.dumps({"cluster": {"worker": ["localhost:0"]}, "task": {"type": "worker", "index": 0}})
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    script = "import towerflow; s = towerflow.Server(); print(s.target, flush=True); s.join()"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=50)
    assert run.returncode == 0, run.stderr
    target = run.stdout.strip()
    assert target.startswith("towerflow://localhost:") and int(target.rsplit(":", 1)[1]) > 0


def test_a_server_of_a_larger_cluster_with_port_0_is_refused_before_it_binds_anything(task_env):
    with pytest.raises(towerflow.ClusterSpecError) as e:
        towerflow.Server({"ps": ["localhost:0"], "worker": ["localhost:2222"]}, "ps", 0, join_timeout=5)
    text = str(e.value)
    assert "port 0 in /job:ps/task:0 ('localhost:0')" in text and "only a cluster of one task" in text
    assert "This cluster has 2 tasks" in text and "Give each task a fixed port" in text


def test_the_launcher_cannot_derive_the_group_port_from_port_0():
    cluster = towerflow.ClusterSpec({"worker": ["localhost:0"]})
    with pytest.raises(LaunchError, match=r"/job:worker/task:0 is at 'localhost:0': port 0 .* Pass --master-port PORT"):
        replica_master(cluster)
    assert replica_master(cluster, 29500) == ("127.0.0.1", 29500)
