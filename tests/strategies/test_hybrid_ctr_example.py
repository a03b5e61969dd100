"""examples/ctr_ps.py in hybrid mode (`--dense allreduce`): the tables on 2 ps tasks in each update mode, the
MLPs all-reduced among the workers. Each run reaches the planted model's best AUC within 0.01, and what a
step sends to the ps tasks is the touched rows and their keys alone, at most 1.05x the rows (no dense
parameter travels). A worker killed mid-run, inside its backward pass, or (the chief) inside a checkpoint
write restarts both workers, and the run ends within 0.005 of the AUC of one left alone."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from _cluster_procs import ROOT, wait_until

EXAMPLE = str(ROOT / "examples" / "ctr_ps.py")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.mark.parametrize("workers, mode", [
    (2, ["--mode", "async"]),
    (2, ["--mode", "sync"]),
    (2, ["--mode", "ssp", "--staleness", "2"]),
    (4, ["--mode", "async"]),
])
def test_the_ctr_example_in_hybrid_mode_reaches_the_best_auc(launcher, workers, mode):
    run = launcher.python("-m", "towerflow", "launch", "--ps", "2", "--workers", str(workers), "--dense", "allreduce",
                          *mode, EXAMPLE, "--rows", "10000", "--steps", "200", "--test-size", "20000",
                          env={"OMP_NUM_THREADS": "1"}, label="hybrid")
    assert run.wait(120) == 0, run.describe()
    assert "HybridStrategy(worker 0 of %d" % workers in run.out, run.out
    auc, best = (float(v) for v in re.search(r"test auc: ([\d.]+) \(best possible: ([\d.]+)\)", run.out).groups())
    assert auc > best - 0.01, run.out
    moved, minimum = (int(v) for v in re.search(r"wire: (\d+) bytes/step \(minimum (\d+)\)", run.out).groups())
    # the rows (dim 16, float32: 64 bytes) read and pushed, each with its key as a one- or two-byte step
    assert minimum <= moved <= minimum * 1.05, run.out


def _auc(out: str) -> float:
    return float(re.search(r"test auc: ([\d.]+)", out).group(1))


KILL_AT = Path(__file__).parent / "_kill_at"  # its sitecustomize stops a task where the test kills it
ARGS = [EXAMPLE, "--rows", "10000", "--steps", "240", "--test-size", "20000", "--save-checkpoint-steps", "40"]
FLAGS = ["--ps", "2", "--workers", "2", "--dense", "allreduce", "--max-restarts", "1"]
_alone: dict = {}


def _auc_left_alone(launcher, tmp_path) -> float:
    """The AUC of the same launch that nobody kills (once per test process)."""
    if "auc" not in _alone:
        alone = launcher.python("-m", "towerflow", "launch", *FLAGS, "--logdir", str(tmp_path / "alone"), *ARGS,
                                env={"OMP_NUM_THREADS": "1"}, label="alone")
        assert alone.wait(120) == 0, alone.describe()
        _alone["auc"] = _auc(alone.out)
    return _alone["auc"]


@pytest.mark.parametrize("moment", ["mid_run", "backward", "checkpoint"])
def test_a_worker_killed_ends_at_the_auc_of_a_run_left_alone(launcher, tmp_path, moment):
    """Killed after the step-80 checkpoint (worker 1, wherever it is), inside worker 1's 12th backward pass,
    or (the chief) inside the write of the step-80 checkpoint: the run ends within 0.005 of the AUC."""
    alone = _auc_left_alone(launcher, tmp_path)
    logdir = tmp_path / "killed"
    env = {"OMP_NUM_THREADS": "1"}
    if moment != "mid_run":
        env.update(KILL_AT=moment, KILL_DIR=str(tmp_path),
                   PYTHONPATH=os.pathsep.join([str(KILL_AT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    run = launcher.python("-m", "towerflow", "launch", *FLAGS, "--logdir", str(logdir), *ARGS, env=env, label="killed")
    if moment == "mid_run":
        wait_until(lambda: "towerflow launch: started" in run.err, 30, "the launch to start its tasks")
        started = re.search(r"towerflow launch: started (.*)", run.err).group(1)
        pids = {name: int(pid) for name, pid in re.findall(r"(/job:\w+/task:\d+) \(pid (\d+)\)", started)}
        wait_until(lambda: any(p.name.startswith("ckpt-0000000080") for p in logdir.glob("ckpt-*.pt"))
                   or run.popen.poll() is not None, 120, "a checkpoint after some training")
        pid = pids["/job:worker/task:1"]
    else:
        marker = tmp_path / "kill-me"
        wait_until(lambda: marker.exists() or run.popen.poll() is not None, 120, f"the moment {moment}")
        assert marker.exists(), run.describe()
        pid = int(marker.read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    assert run.wait(150) == 0, run.describe()
    killed = "/job:worker/task:0" if moment == "checkpoint" else "/job:worker/task:1"
    assert re.search(rf"{killed} \(pid {pid}\) was killed by signal 9", run.err), run.err
    assert "restarting all 2 chief and worker tasks (the ps tasks go on)" in run.err, run.err
    assert abs(_auc(run.out) - alone) < 0.005, (alone, run.out)
