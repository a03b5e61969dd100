"""Issue 6 for all-reduce training: a replica killed mid-training makes the launcher restart every
replica (the process group cannot go on without one), each resumes from the newest checkpoint,
and the run ends with exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from _cluster_procs import wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

TRAIN = str(Path(__file__).parent / "_ft_allreduce.py")
STEPS = "80"


def _final(run) -> str:
    m = re.search(r"\[worker:0\] final: (.*)", run.out)
    assert m, run.describe()
    return m.group(1)


def test_a_killed_replica_restarts_the_group_from_the_checkpoint_exactly(launcher, tmp_path):
    straight_dir, killed_dir = tmp_path / "straight", tmp_path / "killed"
    straight_dir.mkdir()
    killed_dir.mkdir()
    straight = launcher.python("-m", "towerflow", "launch", "--workers", "2", TRAIN, str(straight_dir), STEPS, label="straight")
    assert straight.wait(60) == 0, straight.describe()

    run = launcher.python("-m", "towerflow", "launch", "--workers", "2", "--max-restarts", "1", TRAIN, str(killed_dir),
                          STEPS, label="killed")
    pid_file = killed_dir / "1.0.pid"
    wait_until(lambda: pid_file.exists() or run.popen.poll() is not None, 60, "replica 1 to train")
    pid, step = (int(v) for v in pid_file.read_text().split())
    assert step < int(STEPS) - 20, step
    os.kill(pid, signal.SIGKILL)
    assert run.wait(90) == 0, run.describe()

    assert re.search(r"/job:worker/task:1 \(pid \d+\) was killed by signal 9; restarting all 2 tasks \(1 of 1\)", run.err), run.err
    resumed = re.findall(r"\[worker:(\d)\] rank \d \(restart 1\) resumed at step (\d+)", run.out)
    assert sorted(r for r, _ in resumed) == ["0", "1"] and len({s for _, s in resumed}) == 1, run.out
    assert int(resumed[0][1]) > 0
    assert _final(run) == _final(straight)  # bit for bit: the same batches and updates after the restore
