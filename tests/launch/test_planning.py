"""A launch planned from a `LaunchConfig`, as a program would (no command line), and the command line's
flags arriving as the same config."""

from __future__ import annotations

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
])
def test_a_launch_that_cannot_run_is_refused_with_the_flag_to_change(launch_script, config, message):
    with pytest.raises(TowerflowError, match=message):
        plan_launch(LaunchConfig(script=launch_script, **config))


def test_the_command_line_hands_planning_exactly_its_flags(launch_script):
    args = build_parser().parse_args(["launch", "--ps", "2", "--workers", "3", "--chief", "--mode", "sync",
                                      "--replicas-to-aggregate", "2", "--max-restarts", "1", launch_script, "--epochs", "3"])
    assert config_of(args) == LaunchConfig(script=launch_script, script_args=("--epochs", "3"), ps=2, workers=3, chief=True,
                                           max_restarts=1, mode="sync", replicas_to_aggregate=2)
