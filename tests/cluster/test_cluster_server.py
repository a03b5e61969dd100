"""A real cluster on loopback: 1 ps + 2 workers come up in any order, run remote calls, shut down."""

from __future__ import annotations

import json

import pytest


pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


def test_cluster_runs_remote_calls_and_shuts_down_in_any_start_order(procs, free_ports):
    ps, w0, w1 = free_ports(3)
    cluster = json.dumps({"ps": [f"localhost:{ps}"], "worker": [f"localhost:{w0}", f"localhost:{w1}"]})
    # workers first, the ps last: start order must not matter
    tasks = [procs.python("_cluster_task.py", cluster, job, str(i), label=f"{job}{i}") for job, i in (("worker", 1), ("worker", 0), ("ps", 0))]
    codes = [t.wait(75) for t in tasks]
    assert codes == [0, 0, 0], procs.describe()
    client = tasks[1].out
    for check in ("values", "tensors", "device part", "remote exception", "placement log", "idle"):
        assert f"CHECK {check} ok" in client, procs.describe()
    assert all("DONE" in t.out for t in tasks)
    # a clean end is quiet: no task sees another's connections close while it still counts it live
    assert not any("encountered error" in t.err_path.read_text() for t in tasks), procs.describe()
    assert not any(t.group_alive() for t in tasks), "a task left a process behind"


def test_join_fails_naming_a_task_that_was_killed(procs, free_ports):
    from _cluster_procs import wait_until

    cluster = json.dumps({"worker": [f"localhost:{p}" for p in free_ports(2)]})
    env = {"TOWERFLOW_HEARTBEAT_TIMEOUT": "2"}
    w0 = procs.python("_cluster_serve.py", cluster, "worker", "0", env=env, label="worker0")
    w1 = procs.python("_cluster_serve.py", cluster, "worker", "1", "busy", env=env, label="worker1")
    wait_until(lambda: "UP" in w0.out and "UP" in w1.out, 45, "both tasks up")
    w1.kill_group()  # kill -9: no exit hook runs, nothing says it is done
    assert w0.wait(30) != 0
    assert "/job:worker/task:1" in w0.err and "stopped answering: no heartbeat for 2 s" in w0.err, procs.describe()


def test_a_task_that_raises_makes_the_others_fail_naming_it_in_one_line(procs, free_ports):
    cluster = json.dumps({"worker": [f"localhost:{p}" for p in free_ports(2)]})
    w0 = procs.python("_cluster_serve.py", cluster, "worker", "0", "fail", label="worker0")  # the coordinator fails
    w1 = procs.python("_cluster_serve.py", cluster, "worker", "1", label="worker1")
    assert w0.wait(45) == 1 and w1.wait(45) == 1, procs.describe()
    assert "towerflow: /job:worker/task:0 failed:\nTraceback" in w0.err and "RuntimeError: task broke on purpose" in w0.err
    said = "towerflow: /job:worker/task:1 stopped: /job:worker/task:0 failed: RuntimeError: task broke on purpose"
    assert said in w1.err.splitlines() and "Traceback" not in w1.err, procs.describe()  # the cause, in one line


def test_a_call_to_a_task_that_went_silent_fails_naming_it(procs, tmp_path, free_ports):
    """A task stopped (SIGSTOP: hung, or its host cut off) never fails the call; its heartbeat ends the wait."""
    import os
    import signal

    from _cluster_procs import wait_until

    cluster = json.dumps({"worker": [f"localhost:{p}" for p in free_ports(2)]})
    env = {"TOWERFLOW_HEARTBEAT_TIMEOUT": "2"}
    go = tmp_path / "go"
    w0 = procs.python("_cluster_serve.py", cluster, "worker", "0", "call", str(go), env=env, label="worker0")
    w1 = procs.python("_cluster_serve.py", cluster, "worker", "1", "busy", env=env, label="worker1")
    wait_until(lambda: "UP" in w0.out and "UP" in w1.out, 45, "both tasks up")
    os.kill(w1.popen.pid, signal.SIGSTOP)
    try:
        go.touch()
        assert w0.wait(30) == 0, procs.describe()
    finally:
        os.kill(w1.popen.pid, signal.SIGCONT)
    line = next((l for l in w0.out.splitlines() if l.startswith("CALL")), "")
    assert line.startswith("CALL FAILED"), procs.describe()
    assert "/job:worker/task:1 at localhost:" in line and "stopped answering" in line, line
    assert float(line.split("after ")[1].split(" s")[0]) < 2 + 5
