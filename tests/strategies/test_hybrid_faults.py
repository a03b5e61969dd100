"""Hybrid training loses a worker, and restores a checkpoint onto other numbers of workers and ps tasks.

A worker killed between steps, inside the backward pass (while DDP all-reduces) or, the chief, inside a
checkpoint write: the launcher restarts every worker (their process group cannot go on without one) and
leaves the ps task running; the workers resume the dense part from the newest complete checkpoint, the
tables go on from the ps's own state (not rolled back), and the workers end with equal dense values.
A killed ps task is restored from the newest (hybrid) checkpoint while the workers wait, as under the ps
strategy. A checkpoint of 1 ps + 2 workers restored onto 2 ps + 3 workers starts every worker from the
checkpoint's dense values and optimizer state, and the tables from its rows.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from _cluster_procs import wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

SCRIPT = str(Path(__file__).parent / "_hybrid_faults.py")
ENV = {"OMP_NUM_THREADS": "1"}


def _final_hashes(out: str) -> dict:
    return dict(re.findall(r"rank (\d) final dense (\w+) at step 40", out))


@pytest.mark.parametrize("moment", ["between_steps", "backward", "checkpoint"])
def test_a_killed_worker_restarts_the_workers_and_leaves_the_ps_tables(launcher, tmp_path, moment):
    extra = [] if moment == "between_steps" else [moment]
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--dense", "allreduce",
                          "--max-restarts", "1", SCRIPT, str(tmp_path), "40", *extra, env=ENV, label="hybrid")
    pid_file = tmp_path / ("1.0.pid" if moment == "between_steps" else "kill-me")
    wait_until(lambda: pid_file.exists() or run.popen.poll() is not None, 90, f"the moment {moment}")
    assert pid_file.exists(), run.describe()
    pid, step = (int(v) for v in pid_file.read_text().split())
    os.kill(pid, signal.SIGKILL)
    assert run.wait(100) == 0, run.describe()

    killed = "/job:worker/task:0" if moment == "checkpoint" else "/job:worker/task:1"
    assert re.search(rf"{killed} \(pid \d+\) was killed by signal 9; restarting all 2 chief and worker tasks \(the ps "
                     r"tasks go on\)", run.err), run.err
    assert "/job:ps/task:0 (pid" not in run.err.split("restarting all", 1)[1], run.err  # the ps was not restarted
    resumed = re.search(r"restart 1: resumed at step (\d+) on 2 workers; dense as checkpointed: True; .* "
                        r"ps global step (\d+)", run.out)
    assert resumed, run.out
    checkpoint, ps_step = int(resumed.group(1)), int(resumed.group(2))
    assert checkpoint == (15 if moment == "checkpoint" else 10) and checkpoint <= step
    assert ps_step > 2 * checkpoint  # the tables kept every push since the checkpoint (async: one per worker step)
    hashes = _final_hashes(run.out)
    assert sorted(hashes) == ["0", "1"] and len(set(hashes.values())) == 1, run.out


def test_a_killed_ps_task_is_restored_from_the_hybrid_checkpoint_as_under_the_ps_strategy(launcher, tmp_path):
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--dense", "allreduce",
                          "--max-restarts", "1", SCRIPT, str(tmp_path), "40", env=ENV, label="hybrid")
    wait_until(lambda: (tmp_path / "1.0.pid").exists() or run.popen.poll() is not None, 90, "some training")
    ps = re.search(r"/job:ps/task:0 \(pid (\d+)\)", run.err)
    assert ps, run.err
    os.kill(int(ps.group(1)), signal.SIGKILL)
    assert run.wait(100) == 0, run.describe()
    assert re.search(r"/job:ps/task:0 \(pid \d+\) was killed by signal 9; restarting it \(1 of 1\)", run.err), run.err
    assert re.search(r"/job:ps/task:0 is back \(ps:0:r1\); restored every ps task from ckpt-\d+\.pt", run.err), run.err
    assert "restarting all" not in run.err  # the workers went on: their group was never broken
    hashes = _final_hashes(run.out)
    assert sorted(hashes) == ["0", "1"] and len(set(hashes.values())) == 1, run.out


def test_a_checkpoint_restores_onto_other_numbers_of_workers_and_ps_tasks(launcher, tmp_path):
    first = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--dense", "allreduce",
                            "--mode", "sync", SCRIPT, str(tmp_path), "10", env=ENV, label="first")
    assert first.wait(90) == 0, first.describe()
    second = launcher.python("-m", "towerflow", "launch", "--ps", "2", "--workers", "3", "--dense", "allreduce",
                             "--mode", "sync", SCRIPT, str(tmp_path), "15", env=ENV, label="second")
    assert second.wait(90) == 0, second.describe()
    assert re.search(r"restart 0: resumed at step 10 on 3 workers; dense as checkpointed: True; tables as at the end "
                     r"of the first run: True", second.out), second.out
    hashes = dict(re.findall(r"rank (\d) final dense (\w+) at step 15", second.out))
    assert sorted(hashes) == ["0", "1", "2"] and len(set(hashes.values())) == 1, second.out  # one start for all
