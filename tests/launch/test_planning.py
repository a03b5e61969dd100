"""A launch planned from a `LaunchConfig`, as a program would (no command line), and the command line's
flags arriving as the same config."""

from __future__ import annotations

import json
import os

import pytest

from towerflow.cli import build_parser
from towerflow.cli.launch import config_of
from towerflow.errors import TowerflowError
from towerflow.launch.config import LaunchConfig
from towerflow.launch.planning import plan_launch


def test_an_embedded_cluster_is_planned_from_a_config(launch_script):
    plan = plan_launch(LaunchConfig(script=launch_script, script_args=("--lr", "0.1"), ps=1, workers=2))
    try:
        assert sorted((t.job, t.index) for t in plan.tasks) == [("ps", 0), ("worker", 0), ("worker", 1)]
        assert plan.cluster.num_tasks("worker") == 2 and plan.cluster.num_tasks("ps") == 1
        worker = next(t for t in plan.tasks if t.job == "worker")
        assert worker.argv[-3:] == [launch_script, "--lr", "0.1"]
    finally:
        plan.release()


@pytest.mark.parametrize("config, message", [
    (dict(cluster_file="c.json", ps=1), "--cluster needs --job_name and --task_index"),
    (dict(cluster_file="c.json", job_name="worker", task_index=0, ps=1), "drop --ps/--workers/--chief/--devices/--nproc"),
    (dict(evaluator=True), "--evaluator is a role among a scheduler's ranks"),
    (dict(workers=2, mode="sync"), "--mode sync chooses how parameter servers apply updates; add --ps N"),
    (dict(ps=1, mode="async", staleness=2), "--staleness 2 goes with --mode ssp"),
    (dict(ps=1, workers=1, ps_replicas=2), r"--ps-replicas 2 with --ps 1: expected 1 .* use --ps-replicas 2 with --ps 2"),
    (dict(ps=3, workers=1, ps_replicas=3), "--ps-replicas 3 with --ps 3: expected 1"),
    (dict(workers=2, ps_replicas=2), "--ps-replicas 2 with --ps 0"),
    (dict(ps=2, workers=1, ps_replica_lag=8), "--ps-replica-lag 8 with --ps-replicas None .* --ps-replicas 2 and --mode async"),
    (dict(ps=2, workers=2, ps_replicas=2, mode="sync", ps_replica_lag=8), "--ps-replica-lag 8 .* --mode sync: expected 0"),
    (dict(workers=2, dense="allreduce"), "--dense allreduce says where parameter servers leave the dense layers; add --ps N"),
    (dict(ps=1, workers=2, dense="allreduce", local_steps=4), "--dense allreduce with --local-steps 4: .* drop one"),
])
def test_a_launch_that_cannot_run_is_refused_with_the_flag_to_change(launch_script, config, message):
    with pytest.raises(TowerflowError, match=message):
        plan_launch(LaunchConfig(script=launch_script, **config))


def test_the_command_line_hands_planning_exactly_its_flags(launch_script):
    args = build_parser().parse_args(["launch", "--ps", "2", "--workers", "3", "--chief", "--mode", "sync",
                                      "--replicas-to-aggregate", "2", "--max-restarts", "1", launch_script, "--epochs", "3"])
    assert config_of(args) == LaunchConfig(script=launch_script, script_args=("--epochs", "3"), ps=2, workers=3, chief=True,
                                           max_restarts=1, mode="sync", replicas_to_aggregate=2)


def test_a_hybrid_launch_restarts_the_workers_together_and_leaves_the_ps_tasks(launch_script, monkeypatch):
    monkeypatch.setenv("TOWERFLOW_PS_DENSE", "ps")  # restored when the test ends: planning exports the flag here
    args = build_parser().parse_args(["launch", "--ps", "2", "--workers", "4", "--dense", "allreduce", launch_script])
    config = config_of(args)
    assert config == LaunchConfig(script=launch_script, ps=2, workers=4, dense="allreduce")
    plan = plan_launch(config)
    try:
        assert plan.restart_scope == "replicas"
        assert os.environ["TOWERFLOW_PS_DENSE"] == "allreduce"
    finally:
        plan.release()
    plain = plan_launch(LaunchConfig(script=launch_script, ps=2, workers=4))
    plain.release()
    assert plain.restart_scope == "task"


def _two_host_cluster(tmp_path, monkeypatch):
    """A cluster file with this task on an address of 'this machine' (10.9.8.7) and the ps on another host."""
    from towerflow.cluster import addresses

    monkeypatch.setattr(addresses, "local_addresses", lambda: {"10.9.8.7": "eth0", "127.0.0.1": "lo"})
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"ps": ["10.9.8.6:2222"], "worker": ["10.9.8.7:2222"]}))
    return str(path)


@pytest.mark.parametrize("setting, said, not_said", [
    (None, "towerflow: launcher: wire security: CURVE (encrypted", "PLAIN"),
    ("encrypt", "towerflow: launcher: wire security: CURVE (encrypted", "PLAIN"),
    ("authenticate", "towerflow: launcher: wire security: PLAIN (TOWERFLOW_WIRE_SECURITY=authenticate", "CURVE"),
])
def test_a_cluster_across_hosts_is_told_its_wire_security_once(launch_script, tmp_path, monkeypatch, capsys, setting,
                                                              said, not_said):
    monkeypatch.setenv("TOWERFLOW_CLUSTER_TOKEN", "t")
    if setting is None:
        monkeypatch.delenv("TOWERFLOW_WIRE_SECURITY", raising=False)
    else:
        monkeypatch.setenv("TOWERFLOW_WIRE_SECURITY", setting)
    plan = plan_launch(LaunchConfig(script=launch_script, cluster_file=_two_host_cluster(tmp_path, monkeypatch),
                                    job_name="worker", task_index=0))
    plan.release()
    err = capsys.readouterr().err
    assert err.count("wire security:") == 1 and said in err and not_said not in err, err
    assert "docs/cluster.md" in err and "warning" not in err, err
    if setting != "authenticate":  # the cost, with the machine it was measured on
        assert "half the steps/s" in err and "2 AMD EPYC cores" in err, err


def test_a_cluster_on_one_machine_is_told_nothing_about_the_wire(launch_script, monkeypatch, capsys):
    monkeypatch.delenv("TOWERFLOW_WIRE_SECURITY", raising=False)
    plan_launch(LaunchConfig(script=launch_script, ps=1, workers=2)).release()
    assert "wire security" not in capsys.readouterr().err


def test_a_wire_security_the_tasks_would_refuse_stops_the_launch(launch_script, tmp_path, monkeypatch):
    monkeypatch.setenv("TOWERFLOW_WIRE_SECURITY", "curve")
    with pytest.raises(TowerflowError, match="TOWERFLOW_WIRE_SECURITY='curve': expected one of encrypt, authenticate"):
        plan_launch(LaunchConfig(script=launch_script, cluster_file=_two_host_cluster(tmp_path, monkeypatch),
                                 job_name="worker", task_index=0))


def test_publishing_needs_a_period_and_a_folder(monkeypatch, tmp_path):
    from towerflow import taskenv
    from towerflow.launch.planning import check_publish

    monkeypatch.setenv(taskenv.ENV_PS_PUBLISH_EVERY, "")  # empty is unset; what the launch exports is undone after
    monkeypatch.setenv(taskenv.ENV_PS_PUBLISH_TO, "")
    with pytest.raises(TowerflowError, match="add --publish-every SECONDS"):
        check_publish(LaunchConfig(script="t.py", publish_to=str(tmp_path)))
    with pytest.raises(TowerflowError, match="add --publish-to DIR, or --logdir DIR"):
        check_publish(LaunchConfig(script="t.py", publish_every=10))
    with pytest.raises(TowerflowError, match="expected a positive number of seconds"):
        check_publish(LaunchConfig(script="t.py", publish_every=0, logdir=str(tmp_path)))
    check_publish(LaunchConfig(script="t.py", publish_every=2.5, logdir=str(tmp_path)))
    task = taskenv.from_environment()
    assert task.ps.publish_every == 2.5 and task.ps.publish_to == str(tmp_path / "publish")
    assert task.ps.publish_snapshot_every is None  # by volume


def test_snapshot_every_reaches_the_ps_tasks_for_a_folder_and_is_refused_for_redis(monkeypatch, tmp_path):
    import argparse

    from towerflow import taskenv
    from towerflow.cli.launch import _snapshot_every
    from towerflow.launch.planning import check_publish

    for name in (taskenv.ENV_PS_PUBLISH_EVERY, taskenv.ENV_PS_PUBLISH_TO, taskenv.ENV_PS_PUBLISH_SNAPSHOT_EVERY):
        monkeypatch.setenv(name, "")  # empty is unset; what the launch exports is undone after
    assert _snapshot_every("auto") is None and _snapshot_every("7") == 7
    with pytest.raises(argparse.ArgumentTypeError, match="expected 'auto'"):
        _snapshot_every("0")
    with pytest.raises(TowerflowError, match="add --publish-every SECONDS"):
        check_publish(LaunchConfig(script="t.py", snapshot_every=3, logdir=str(tmp_path)))
    with pytest.raises(TowerflowError, match="drop --snapshot-every"):
        check_publish(LaunchConfig(script="t.py", publish_every=1, publish_to="redis://127.0.0.1:6379/0",
                                   snapshot_every=3))
    check_publish(LaunchConfig(script="t.py", publish_every=1, logdir=str(tmp_path), snapshot_every=3))
    assert taskenv.from_environment().ps.publish_snapshot_every == 3
    check_publish(LaunchConfig(script="t.py", publish_every=1, logdir=str(tmp_path)))
    assert taskenv.from_environment().ps.publish_snapshot_every is None
