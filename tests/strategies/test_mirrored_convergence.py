"""examples/mnist_sync.py, unchanged, converges under 1 and 2 logical CPU devices (digits data).

The global batch is fixed, so the replica count must not change the result: both runs reach the
stated accuracy, and the 2-replica run lands where the 1-replica run does (4 replicas:
tests/strategies/test_equivalence.py, which checks the averaging itself, exactly).
"""

import os
import re
import subprocess
import sys

import pytest

from _replicas import REPO, run_replicas

SCRIPT = os.path.join(REPO, "examples", "mnist_sync.py")
ARGS = ["--steps", "400", "--batch-size", "64", "--seed", "1"]
THRESHOLD = 0.90  # digits, last 360 images; one replica reaches ~0.93 in 400 steps

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def _accuracy(stdout: str) -> float:
    found = re.findall(r"^test accuracy: (\d\.\d{4})$", stdout, re.M)
    assert len(found) == 1, f"expected one 'test accuracy: 0.NNNN' line from the chief, got:\n{stdout}"
    return float(found[0])


@pytest.fixture(scope="module")
def one_replica():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TF_CONFIG")}
    env["PYTHONPATH"] = os.path.join(REPO, "src")
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, SCRIPT, *ARGS], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    return _accuracy(done.stdout)


def test_one_device(one_replica):
    assert one_replica >= THRESHOLD


@pytest.mark.parametrize("n", [2])
def test_n_logical_cpu_devices(n, one_replica):
    results = run_replicas([SCRIPT, *ARGS], n, timeout=120)
    accuracy = _accuracy(results[0].stdout)
    assert accuracy >= THRESHOLD
    assert abs(accuracy - one_replica) <= 0.02, (accuracy, one_replica)
    assert all("test accuracy" not in r.stdout for r in results[1:])  # only the chief prints
    assert f"replica 0 of {n}" in results[0].stdout
