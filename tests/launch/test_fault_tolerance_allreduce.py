"""All-reduce training: a replica killed mid-training makes the launcher restart every
replica (the process group cannot go on without one), each resumes from the newest checkpoint,
and the run ends with exactly the parameters of an uninterrupted run.

Two moments: replica 1 after the step-10 checkpoint, and the chief inside the write of
its step-20 checkpoint (the payload in a temporary file, not renamed yet): that half-written
checkpoint must not count, so the group resumes at step 10 and still ends bit for bit the same.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from _cluster_procs import Procs, wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

TRAIN = str(Path(__file__).parent / "_ft_allreduce.py")
STEPS = "80"


def _final(run) -> str:
    m = re.search(r"\[worker:0\] final: (.*)", run.out)
    assert m, run.describe()
    return m.group(1)


@pytest.fixture(scope="module")
def straight_final(tmp_path_factory) -> str:
    """The final parameters' hash of an uninterrupted run (one for both moments)."""
    folder = tmp_path_factory.mktemp("straight")
    procs = Procs(folder)
    straight = procs.python("-m", "towerflow", "launch", "--workers", "2", TRAIN, str(folder), STEPS, label="straight")
    try:
        assert straight.wait(60) == 0, straight.describe()
        return _final(straight)
    finally:
        straight.kill_group()


@pytest.mark.parametrize("moment", ["after_checkpoint", "checkpoint"])
def test_a_killed_replica_restarts_the_group_from_the_checkpoint_exactly(launcher, tmp_path, straight_final, moment):
    run = launcher.python("-m", "towerflow", "launch", "--workers", "2", "--max-restarts", "1", TRAIN, str(tmp_path),
                          STEPS, *(["checkpoint"] if moment == "checkpoint" else []), label="killed")
    pid_file = tmp_path / ("kill-me" if moment == "checkpoint" else "1.0.pid")
    wait_until(lambda: pid_file.exists() or run.popen.poll() is not None, 60, f"the moment {moment}")
    assert pid_file.exists(), run.describe()
    pid, step = (int(v) for v in pid_file.read_text().split())
    assert step < int(STEPS) - 20, step
    os.kill(pid, signal.SIGKILL)
    assert run.wait(90) == 0, run.describe()

    killed = "/job:worker/task:0" if moment == "checkpoint" else "/job:worker/task:1"
    assert re.search(rf"{killed} \(pid \d+\) was killed by signal 9; restarting all 2 tasks \(1 of 1\)", run.err), run.err
    resumed = re.findall(r"\[worker:(\d)\] rank \d \(restart 1\) resumed at step (\d+)", run.out)
    assert sorted(r for r, _ in resumed) == ["0", "1"] and len({s for _, s in resumed}) == 1, run.out
    if moment == "checkpoint":
        assert resumed[0][1] == "10", run.out  # the step-20 checkpoint was never completed
    else:
        assert int(resumed[0][1]) > 0
    assert _final(run) == straight_final  # bit for bit: the same batches and updates after the restore
