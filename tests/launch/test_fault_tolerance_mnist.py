"""A 1 ps + 2 worker MNIST run under `towerflow launch` in which the test kills a
worker, then the ps, then the chief (each SIGKILL, each after the previous recovery) still
finishes its step budget and reaches the undisturbed run's accuracy target (0.95).

What each recovery must look like:
* worker 1: the launcher restarts it, it rejoins and trains on (the others never stop);
* the ps: the launcher restarts it empty, the chief restores every ps task from the newest
  checkpoint (the others wait for that), and all go on from that checkpoint's step;
* the chief (worker 0): the store lives in the launcher, so the restarted chief rejoins; the ps
  kept training with worker 1, so the chief keeps that state (it does not go back to a checkpoint).
`pytest -s` prints the measured recovery times.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from _cluster_procs import ROOT, wait_until

REPO = str(ROOT)
DATA = os.path.join(REPO, "..", "shared", "data", "mnist-t10k")
STEPS = 2400  # global steps: enough that training is still going after three recoveries on 2 cores

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(400),
    pytest.mark.skipif(not os.path.isdir(DATA), reason="MNIST-t10k not found at ../shared/data/mnist-t10k"),
]


def _pids(text: str) -> dict:
    started = re.search(r"towerflow launch: started (.*)", text)
    assert started, text
    return {name: int(pid) for name, pid in re.findall(r"(/job:\w+/task:\d+) \(pid (\d+)\)", started.group(1))}


def _global_step(run) -> int:
    steps = re.findall(r"\[worker:\d\] step (\d+)/", run.out)
    return int(steps[-1]) if steps else 0


def _kill(run, pids: dict, task: str, until: str, timeout: float) -> float:
    """SIGKILL `task`, then wait until `until` shows up in the launch's stderr; returns the seconds it took."""
    os.kill(pids[task], signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: until in run.err or run.popen.poll() is not None, timeout, f"recovery of {task}")
    assert until in run.err, f"no {until!r} after killing {task}\n{run.describe()}"
    return time.monotonic() - killed


def test_mnist_survives_a_killed_worker_then_ps_then_chief(launcher, tmp_path):
    logdir = tmp_path / "run"
    run = launcher.python(
        "-m", "towerflow", "launch", "--ps", "1", "--workers", "2", "--max-restarts", "1", "--logdir", str(logdir),
        os.path.join(REPO, "examples", "mnist_ps.py"), "--data", DATA, "--steps", str(STEPS),
        "--save-checkpoint-steps", "100",
    )
    wait_until(lambda: "towerflow launch: started" in run.err, 30, "the launch to start its tasks")
    pids = _pids(run.err)
    assert set(pids) == {"/job:ps/task:0", "/job:worker/task:0", "/job:worker/task:1"}, pids

    # 1. a worker
    wait_until(lambda: _global_step(run) >= 200 or run.popen.poll() is not None, 90, "training to pass step 200")
    worker_s = _kill(run, pids, "/job:worker/task:1", "[worker:1] towerflow: /job:worker/task:1 rejoined training", 60)

    # 2. the ps, once a checkpoint newer than the one before the worker's kill exists
    at_ps_kill = _global_step(run)
    ps_s = _kill(run, pids, "/job:ps/task:0", "[worker:1] towerflow: /job:worker/task:1: /job:ps/task:0 is back", 90)
    wait_until(lambda: "[worker:0] towerflow: /job:worker/task:0: /job:ps/task:0 is back" in run.err, 30, "the chief's recovery")
    restored = re.search(r"\[worker:0\] towerflow: /job:worker/task:0: /job:ps/task:0 is back \(ps:0:r1\); restored every "
                         r"ps task from (ckpt-\d+\.pt); going on at global step (\d+); lost: (\d+) global steps", run.err)
    assert restored, run.err
    ckpt_step = int(restored.group(2))
    assert ckpt_step >= at_ps_kill - 200, (ckpt_step, at_ps_kill)  # a checkpoint every ~100 steps: little is lost

    # 3. the chief
    wait_until(lambda: _global_step(run) >= ckpt_step + 100 or run.popen.poll() is not None, 60, "training after the ps restore")
    chief_s = _kill(run, pids, "/job:worker/task:0", "[worker:0] towerflow: /job:worker/task:0 rejoined training", 90)

    assert run.wait(240) == 0, run.describe()
    err = run.err
    for task, count in (("worker:1", 1), ("ps:0", 1), ("worker:0", 1)):
        assert len(re.findall(rf"/job:{task.split(':')[0]}/task:{task.split(':')[1]} \(pid \d+\) was killed by signal 9; "
                              r"restarting it \(1 of 1\)", err)) == count, err
    assert "towerflow: worker:0: kept the running state at global step" in err, err  # the chief did not go back
    accuracy = re.search(r"\[worker:0\] test accuracy: (\d\.\d{4})", run.out)
    assert accuracy and float(accuracy.group(1)) >= 0.95, run.describe()
    final = re.search(r"\[worker:0\] (\d+) global steps in", run.out)
    assert final and int(final.group(1)) >= STEPS, run.out  # the whole step budget, counted from the restore
    ps_line = re.search(r"/job:ps/task:0: (\d+) updates", run.out)
    assert ps_line and int(ps_line.group(1)) > 0, run.out
    print(f"recovery (SIGKILL to training again): worker {worker_s:.1f} s, ps {ps_s:.1f} s, chief {chief_s:.1f} s; "
          f"the ps was restored from {restored.group(1)} (step {ckpt_step}), losing {restored.group(3)} steps; "
          f"test accuracy {accuracy.group(1)}")
