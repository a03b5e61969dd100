"""A worker killed during synchronous ps training.

* with a backup worker (2 of 3 gradients per update) the job goes on while the launcher
  restarts it, and the restarted worker rejoins; the kill lands during a sync round:
  worker 1 has pushed and its pull waits at the ps for the round's update;
* without one, the others wait for the restarted worker (the global step stands still), then
  all go on;
* without one and without restarts, the others stop waiting once its heartbeat has been silent
  for TOWERFLOW_HEARTBEAT_TIMEOUT and fail with an error naming it (a hand-started cluster:
  under `towerflow launch` the launcher already stops the job when a task dies for good).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from _cluster_procs import wait_until


pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

TRAIN = str(Path(__file__).parent / "_ft_train.py")


def _kill_worker_1(run, folder: Path) -> int:
    """SIGKILL worker 1 after its first 20 steps; returns the global step it had then."""
    pid_file = folder / "worker:1.0.pid"
    wait_until(lambda: pid_file.exists() or run.popen.poll() is not None, 60, "worker 1 to start training")
    assert pid_file.exists(), run.describe()
    pid, step = (int(v) for v in pid_file.read_text().split())
    os.kill(pid, signal.SIGKILL)
    return step


def _rejoined_at(run) -> tuple:
    """(the global step when worker 1 rejoined, the pushes the ps had from its killed incarnation)."""
    wait_until(lambda: "rejoined training" in run.err or run.popen.poll() is not None, 60, "worker 1 to rejoin")
    m = re.search(r"\[worker:1\] towerflow: /job:worker/task:1: rejoined training \(restart 1\) at global step (\d+); "
                  r"the ps kept its (\d+) earlier pushes", run.err)
    assert m, run.describe()
    return int(m.group(1)), int(m.group(2))


def _assert_fit(run) -> None:
    fit = re.search(r"final: w: ([-\d.]+), b: ([-\d.]+)", run.out)
    assert fit and abs(float(fit.group(1)) - 2.0) < 0.1 and abs(float(fit.group(2)) - 0.2) < 0.1, run.out


def test_sync_with_a_backup_worker_goes_on_while_a_worker_killed_during_a_round_restarts(launcher, tmp_path):
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "3", "--mode", "sync",
                          "--replicas-to-aggregate", "2", "--max-restarts", "1", TRAIN, str(tmp_path), "600",
                          "sync_round")
    wait_until(lambda: (tmp_path / "kill-me").exists() or run.popen.poll() is not None, 60, "worker 1 to wait for a round")
    assert (tmp_path / "kill-me").exists(), run.describe()
    started = re.search(r"/job:worker/task:1 \(pid (\d+)\)", run.err)
    os.kill(int(started.group(1)), signal.SIGKILL)
    (tmp_path / "resume").write_text("")  # the chief and worker 2 go on: 2 of 3 gradients make each update
    rejoined_at, pushes = _rejoined_at(run)
    # the two others made updates meanwhile (without a backup the step stands still: the next test); a restart
    # from the fork server takes about a second, some ten updates here
    assert rejoined_at >= pushes + 5, (pushes, rejoined_at)
    assert run.wait(90) == 0, run.describe()
    _assert_fit(run)
    assert "'rejoins_by_worker': {1: 1}" in run.out, run.out


def test_sync_without_backups_waits_for_the_restarted_worker(launcher, tmp_path):
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--mode", "sync",
                          "--max-restarts", "1", TRAIN, str(tmp_path), "600")
    killed_at = _kill_worker_1(run, tmp_path)
    rejoined_at, pushes = _rejoined_at(run)
    assert killed_at <= rejoined_at <= pushes, (killed_at, pushes, rejoined_at)  # no update without worker 1's gradient
    assert run.wait(90) == 0, run.describe()
    _assert_fit(run)
    assert "'rejoins_by_worker': {1: 1}" in run.out, run.out


def test_sync_without_backups_or_restarts_fails_naming_the_dead_worker(procs, tmp_path, free_ports):
    ports = free_ports(3)
    flags = ["--ps_hosts", f"localhost:{ports[0]}", "--worker_hosts", f"localhost:{ports[1]},localhost:{ports[2]}"]
    env = {"TOWERFLOW_PS_MODE": "sync", "TOWERFLOW_HEARTBEAT_TIMEOUT": "3"}
    ps = procs.python(TRAIN, str(tmp_path), "100000", *flags, "--job_name", "ps", "--task_index", "0", env=env, label="ps")
    w0 = procs.python(TRAIN, str(tmp_path), "100000", *flags, "--job_name", "worker", "--task_index", "0", env=env, label="w0")
    w1 = procs.python(TRAIN, str(tmp_path), "100000", *flags, "--job_name", "worker", "--task_index", "1", env=env, label="w1")
    _kill_worker_1(w1, tmp_path)
    killed = time.monotonic()
    assert w0.wait(30) != 0, w0.describe()
    waited = time.monotonic() - killed
    assert re.search(r"/job:worker/task:1 at localhost:\d+ stopped answering: no heartbeat for 3 s", w0.err), w0.describe()
    assert 3 <= waited < 20, waited  # the heartbeat timeout, not a hang
    assert ps.wait(30) != 0, ps.describe()
