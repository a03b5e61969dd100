"""A worker SIGKILLed during async ps training is restarted by the
launcher, rejoins under a new call name, pulls the ps's current values and goes on; the others
never stop. The measured recovery time is printed (pytest -s shows it)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from _cluster_procs import wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]

TRAIN = str(Path(__file__).parent / "_ft_train.py")


def test_a_killed_worker_is_restarted_and_rejoins_async_training(launcher, tmp_path):
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--max-restarts", "1",
                          TRAIN, str(tmp_path), "1500")
    pid_file = tmp_path / "worker:1.0.pid"  # written by worker 1 after its first 20 steps
    wait_until(lambda: pid_file.exists() or run.popen.poll() is not None, 45, "worker 1 to start training")
    assert pid_file.exists(), run.describe()
    os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: "rejoined training" in run.err or run.popen.poll() is not None, 40, "worker 1 to rejoin")
    recovery_s = time.monotonic() - killed
    assert run.wait(60) == 0, run.describe()

    assert re.search(r"/job:worker/task:1 \(pid \d+\) was killed by signal 9; restarting it \(1 of 1\)", run.err), run.err
    assert "[worker:1] towerflow: /job:worker/task:1: rejoined the cluster (restart 1) as worker:1:r1, in place of " \
           "worker:1" in run.err, run.err
    m = re.search(r"rejoined training \(restart 1\) at global step (\d+); the ps kept its (\d+) earlier pushes;.*"
                  r"down ([\d.]+) s", run.err)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) >= 20, run.err
    after = re.search(r"\[worker:1\] worker 1 \(restart 1\): (\d+) steps, global step (\d+)", run.out)
    assert "[worker:0] worker 0 (restart 0):" in run.out and after, run.out
    assert int(after.group(1)) >= 50 and int(after.group(2)) > int(m.group(1)), run.out  # it trained on after rejoining
    assert "'rejoins_by_worker': {1: 1}" in run.out, run.out
    fit = re.search(r"final: w: ([-\d.]+), b: ([-\d.]+)", run.out)
    assert fit and abs(float(fit.group(1)) - 2.0) < 0.1 and abs(float(fit.group(2)) - 0.2) < 0.1, run.out
    print(f"recovery: {recovery_s:.1f} s from SIGKILL to the restarted worker training again "
          f"(the worker's own count: {m.group(3)} s); it rejoined at global step {m.group(1)}")


def test_a_worker_that_raises_is_restarted_and_training_goes_on(launcher, tmp_path):
    """Its own error, not a kill: under --max-restarts the launcher restarts it, and the ps and the
    chief treat it as a lost task that comes back (they used to stop on its recorded failure)."""
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--max-restarts", "1",
                          TRAIN, str(tmp_path), "800", "raise")
    assert run.wait(80) == 0, run.describe()
    assert "RuntimeError: injected failure in worker 1" in run.err, run.err
    assert "rejoined training (restart 1)" in run.err, run.err
    fit = re.search(r"final: w: ([-\d.]+), b: ([-\d.]+)", run.out)
    assert fit and abs(float(fit.group(1)) - 2.0) < 0.1 and abs(float(fit.group(2)) - 0.2) < 0.1, run.out
