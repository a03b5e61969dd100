"""examples/cifar10_towers.py runs on one device and on two replicas with the variables kept on the CPU (`variables_on="cpu"`)."""

import json
import os
import re
import subprocess
import sys

import pytest

from _replicas import REPO, run_replicas

SCRIPT = os.path.join(REPO, "examples", "cifar10_towers.py")
ARGS = ["--steps", "4", "--batch-size", "32", "--width", "8"]

pytestmark = pytest.mark.timeout(120)


def test_one_device_writes_metrics_and_the_accuracy_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TF_CONFIG")}
    env["PYTHONPATH"] = os.path.join(REPO, "src")
    done = subprocess.run([sys.executable, SCRIPT, *ARGS, "--logdir", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^test accuracy: \d\.\d{4}$", done.stdout, re.M), done.stdout
    assert json.loads((tmp_path / "metrics.json").read_text())["global_step"] == 4


@pytest.mark.multiprocess
def test_two_replicas_with_variables_on_the_cpu():
    results = run_replicas([SCRIPT, *ARGS, "--variables-on", "cpu"], 2, timeout=100)
    assert "test accuracy: " in results[0].stdout and "replica 0 of 2" in results[0].stdout
