"""examples/ctr_ps.py on 2 ps + 2 workers, its tables on the ps tasks, loses ps:1, then ps:0 while the
workers wait for ps:1's restart, and, once a checkpoint newer than that restore exists, ps:0 again
(SIGKILL); every table row and its optimizer state come back from the newest checkpoint each time and
the run still ends within 0.01 of the best possible AUC, moving at most 1.1x the minimum bytes per step.
(Two ps tasks lost at the same instant: tests/ps/test_replicas_kill.py, a part with every replica lost.)"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from _cluster_procs import ROOT, wait_until

EXAMPLE = str(ROOT / "examples" / "ctr_ps.py")
STEPS = 400

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _checkpoint_steps(logdir: Path) -> list:
    return sorted(int(m.group(1)) for p in logdir.glob("ckpt-*.pt") if (m := re.match(r"ckpt-(\d+)\.pt$", p.name)))


def _launch_until_a_checkpoint(launcher, logdir: Path, steps: int):
    """2 ps + 2 workers of the CTR example, each task restartable twice; returns once a checkpoint of step
    40 or later exists, with the run and the pid of each task."""
    run = launcher.python("-m", "towerflow", "launch", "--ps", "2", "--workers", "2", "--max-restarts", "2",
                          "--logdir", str(logdir), EXAMPLE, "--rows", "10000", "--steps", str(steps),
                          "--test-size", "20000", "--save-checkpoint-steps", "40")
    wait_until(lambda: "towerflow launch: started" in run.err, 30, "the launch to start its tasks")
    started = re.search(r"towerflow launch: started (.*)", run.err).group(1)
    pids = {name: int(pid) for name, pid in re.findall(r"(/job:\w+/task:\d+) \(pid (\d+)\)", started)}
    wait_until(lambda: any(s >= 40 for s in _checkpoint_steps(logdir)) or run.popen.poll() is not None, 120,
               "a checkpoint after some training")
    return run, pids


def _kill_ps(run, pids: dict, task: int, count: int) -> float:
    os.kill(pids[f"/job:ps/task:{task}"], signal.SIGKILL)
    killed = time.monotonic()
    back = f"[worker:0] towerflow: /job:worker/task:0: /job:ps/task:{task} is back"
    wait_until(lambda: run.err.count(back) >= count or run.popen.poll() is not None, 90, f"ps:{task}'s recovery")
    assert run.err.count(back) >= count, run.describe()
    return time.monotonic() - killed


def test_ctr_on_two_ps_survives_killed_ps_tasks_and_reaches_the_best_auc(launcher, tmp_path):
    logdir = tmp_path / "run"
    run, pids = _launch_until_a_checkpoint(launcher, logdir, STEPS)
    os.kill(pids["/job:ps/task:1"], signal.SIGKILL)
    wait_until(lambda: "lost /job:ps/task:1" in run.err or run.popen.poll() is not None, 60, "the first loss seen")
    os.kill(pids["/job:ps/task:0"], signal.SIGKILL)  # while the workers wait for ps:1's restart: one restore for both
    killed = time.monotonic()
    # the chief says the loss it saw is over: ps:0's, ps:1's, or both (a restart in a tenth of a second can be over
    # before its loss is seen; the restore puts every ps task back either way)
    chief_back = re.compile(r"\[worker:0\] towerflow: /job:worker/task:0: /job:ps/task:[01] is back")
    wait_until(lambda: chief_back.search(run.err) or run.popen.poll() is not None, 90, "the chief's recovery")
    assert chief_back.search(run.err), run.describe()
    first_s = time.monotonic() - killed
    for task in (0, 1):
        assert f"[ps:{task}] towerflow: /job:ps/task:{task}: rejoined the cluster (restart 1)" in run.err, run.describe()
    restored = int(re.findall(r"restored every ps task from ckpt-(\d+)\.pt", run.err)[-1])
    wait_until(lambda: any(s >= restored + 60 for s in _checkpoint_steps(logdir)) or run.popen.poll() is not None, 120,
               "training past the first restore")
    assert run.popen.poll() is None, run.describe()
    pids["/job:ps/task:0"] = int(re.findall(r"/job:ps/task:0 \(pid \d+\) .*; restarting it \(\d of 2\) as pid (\d+)",
                                            run.err)[-1])
    second_s = _kill_ps(run, pids, 0, run.err.count("[worker:0] towerflow: /job:worker/task:0: /job:ps/task:0 is back") + 1)

    assert run.wait(200) == 0, run.describe()
    got = re.search(r"\[worker:0\] test auc: (\d\.\d{4}) \(best possible: (\d\.\d{4})\)", run.out)
    assert got, run.describe()
    test_auc, best = float(got.group(1)), float(got.group(2))
    assert test_auc >= best - 0.01, run.describe()
    wire = re.search(r"\[worker:0\] wire: (\d+) bytes/step \(minimum (\d+)\)", run.out)
    assert wire and int(wire.group(1)) <= 1.1 * int(wire.group(2)), run.out
    assert len(re.findall(r"restored every ps task from ckpt-\d+\.pt", run.err)) >= 2, run.err
    print(f"ps:1 and ps:0 back after {first_s:.1f} s, ps:0 again after {second_s:.1f} s; test auc {test_auc} (best {best})")
