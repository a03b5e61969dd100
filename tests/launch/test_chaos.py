"""The short version of benchmarks/chaos.py: a 1 ps + 2 worker MNIST run under `towerflow launch` with a
task SIGKILLed at a random moment, twice (the ps, then the chief, at the seed used here), ends well.

The run must exit 0, both kills must be recovered (the ps restored from the newest checkpoint, the chief
rejoined), at most one checkpoint interval of global steps lost, and the test accuracy must reach the
undisturbed run's target (0.95). The full runs (minutes, a kill every 30 s, three namespace hosts,
whole hosts lost) are the benchmark's, with their numbers in docs/fault-tolerance.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _cluster_procs import ROOT

DATA = os.path.join(str(ROOT), "..", "shared", "data", "mnist-t10k")

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not os.path.isdir(DATA), reason="MNIST-t10k not found at ../shared/data/mnist-t10k"),
]


def test_random_kills_of_the_ps_and_the_chief_end_with_a_trained_model(tmp_path):
    out = tmp_path / "chaos.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--no-clean", "--steps", "1500", "--every", "4",
            "--max-kills", "2", "--seed", "4", "--data", DATA, "--timeout", "240", "--out", str(tmp_path / "runs"),
            "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    chaos = json.loads(out.read_text())["chaos"]
    assert chaos["exit_code"] == 0, chaos["tail"]
    assert [k["task"] for k in chaos["kills"]] == ["/job:ps/task:0", "/job:worker/task:0"], chaos["kills"]
    assert all(k["recovered_s"] is not None for k in chaos["kills"]), chaos["kills"]
    assert 0 <= chaos["steps_lost"] <= 100  # a checkpoint every 100 global steps
    assert chaos["accuracy"] >= 0.95
