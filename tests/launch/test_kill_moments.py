"""A restarted task always rejoins, wherever in the run its SIGKILL landed.

Async ps training (1 ps + 2 workers, `_ft_train.py`), worker 1 killed at a moment the helper
holds it at (no sleep-and-hope), each run ending with exit 0 and the fitted line:

* before its first step: in the cluster, before setup; the restart rejoins and trains;
* after it finished, the cluster still running: its restart rejoins, learns from the ps that it
  had finished, trains no more, and the run ends when the chief does.

A restart that comes after the cluster ended (nothing to rejoin: it exits 0) is the end's protocol
against a rejoin at every interleaving of their store calls: tests/cluster/test_cluster_ending.py.

Mid-run kills are tests/launch/test_fault_tolerance.py (async) and test_fault_tolerance_sync.py
(sync, one during a round); a kill inside a checkpoint write is test_fault_tolerance_allreduce.py.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Optional

import pytest

from _cluster_procs import wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

TRAIN = str(Path(__file__).parent / "_ft_train.py")
STEPS = "300"  # global steps: the fit is within 0.15 of the line by then
RESTARTED = r"/job:worker/task:1 \(pid \d+\) was killed by signal 9; restarting it \(1 of 1\)"


def _kill_at_the_moment(run, folder: Path, victim: Optional[int] = None) -> int:
    """Wait until worker 1 is where the helper holds it, SIGKILL it (or the `victim` pid then); returns the
    global step then."""
    marker = folder / "kill-me"
    wait_until(lambda: marker.exists() or run.popen.poll() is not None, 60, "worker 1 to reach the moment")
    assert marker.exists(), run.describe()
    pid, step = (int(v) for v in marker.read_text().split())
    os.kill(victim or pid, signal.SIGKILL)
    (folder / "killed").write_text("")
    return step


def _assert_fit(run) -> None:
    """Near the line y = 2x + 0.2 (from w = -1, b = -2): asynchronous steps, whose staleness a loaded machine varies,
    land within 0.15 of it."""
    fit = re.search(r"final: w: ([-\d.]+), b: ([-\d.]+)", run.out)
    assert fit and abs(float(fit.group(1)) - 2.0) < 0.15 and abs(float(fit.group(2)) - 0.2) < 0.15, run.describe()


@pytest.mark.parametrize("moment", ["before_first_step", "finished"])
def test_a_worker_killed_at_any_moment_is_restarted_and_the_run_ends_well(launcher, tmp_path, moment):
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--max-restarts", "1",
                          TRAIN, str(tmp_path), STEPS, moment)
    killed_at = _kill_at_the_moment(run, tmp_path)
    assert run.wait(90) == 0, run.describe()
    assert re.search(RESTARTED, run.err), run.describe()
    _assert_fit(run)
    rejoined = re.search(r"\[worker:1\] towerflow: /job:worker/task:1: rejoined training \(restart 1\) at global step "
                         r"(\d+); the ps kept its (\d+) earlier pushes; lost: (.*?); down", run.err)
    assert rejoined, run.describe()
    assert "'rejoins_by_worker': {1: 1}" in run.out, run.out
    after = re.search(r"\[worker:1\] worker 1 \(restart 1\): (\d+) steps", run.out)
    assert after, run.out
    if moment == "before_first_step":
        assert killed_at == 0 and rejoined.group(2) == "0", run.describe()  # it had pushed nothing
        assert int(after.group(1)) >= 50, run.out  # and trained after rejoining
    else:
        assert int(rejoined.group(1)) >= killed_at >= int(STEPS), run.describe()
        assert rejoined.group(3) == "nothing: it had finished training before it was killed, so it trains no more"
        assert int(after.group(1)) == 0, run.out


@pytest.mark.parametrize("moment", ["joining", "joining_served"])
def test_the_chief_killed_while_another_task_is_joining_does_not_stop_the_join(launcher, tmp_path, moment):
    victim = "/job:worker/task:0"  # a ps lost here needs a checkpoint to come back from: tests/ps/test_ctr_example.py
    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--max-restarts", "1",
                          TRAIN, str(tmp_path), STEPS, moment)
    wait_until(lambda: "towerflow launch: started" in run.err, 30, "the launch to start its tasks")
    started = re.search(r"towerflow launch: started (.*)", run.err).group(1)
    pids = {name: int(pid) for name, pid in re.findall(r"(/job:\w+/task:\d+) \(pid (\d+)\)", started)}
    first = tmp_path / "worker:1.0.pid"
    wait_until(lambda: first.exists() or run.popen.poll() is not None, 60, "worker 1 to train 20 steps")
    assert first.exists(), run.describe()
    os.kill(int(first.read_text().split()[0]), signal.SIGKILL)
    _kill_at_the_moment(run, tmp_path, pids[victim])  # worker 1's restart is inside its join now
    assert run.wait(90) == 0, run.describe()
    assert "[worker:1] towerflow: /job:worker/task:1: rejoined the cluster (restart 1)" in run.err, run.describe()
    assert re.search(rf"{re.escape(victim)} \(pid \d+\) was killed by signal 9; restarting it", run.err), run.describe()
    _assert_fit(run)

