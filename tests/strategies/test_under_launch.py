"""The examples run unchanged under the real `towerflow launch --workers 2` (the environment contract)."""

import os
import re
import subprocess
import sys

import pytest

from _replicas import REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def test_mnist_sync_under_towerflow_launch_with_two_workers():
    pytest.importorskip("towerflow.launch")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TF_CONFIG")}
    env["PYTHONPATH"] = os.path.join(REPO, "src")
    cmd = [sys.executable, "-m", "towerflow", "launch", "--workers", "2", os.path.join(REPO, "examples", "mnist_sync.py"),
           "--steps", "300", "--seed", "1"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=140)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    out = done.stdout + done.stderr
    assert "MultiWorkerMirroredStrategy(replica 0 of 2" in out
    found = re.findall(r"test accuracy: (\d\.\d{4})", out)
    assert len(found) == 1, out  # the chief prints it, once
    assert float(found[0]) >= 0.88, out  # digits, 300 steps of global batch 64
