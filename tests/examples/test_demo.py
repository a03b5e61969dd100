"""`towerflow demo` (what `make demo` runs), with a step budget small enough for CI."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess  # starts processes

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_demo_trains_on_an_embedded_cluster_and_says_where_everything_went(tmp_path):
    logdir = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "towerflow", "demo", "--steps", "400", "--logdir", str(logdir)],
        cwd=ROOT, capture_output=True, text=True, timeout=230,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    # The device mapping and a few placement-log lines, from the chief.
    assert "[worker:0] /job:worker/replica:0/task:0/device:CPU:0 -> device: 0" in out
    assert re.search(r"\[worker:0\] conv2d: \(Conv2d\): /job:worker/replica:0/task:0/device:CPU:0", out)
    # Progress from each worker, then the chief's result.
    assert re.search(r"\[worker:1\] step \d+  loss ", out) and re.search(r"\[worker:0\] step \d+  loss ", out)
    accuracy = float(re.search(r"\[worker:0\] test accuracy: (\d\.\d{4})", out).group(1))
    assert accuracy >= 0.8
    # One line per artefact, each with the command to look at it; every path exists where it says.
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^  (\w+) +(\S+)", out, re.M)}
    assert {"checkpoint", "metrics", "report", "dashboard"} <= set(lines), out[-2000:]
    paths = {k: (ROOT / v).resolve() for k, v in lines.items()}
    assert paths["checkpoint"].exists() and paths["checkpoint"].parent == logdir.resolve()
    assert re.search(r"^  metrics +\S+ +towerflow top ", out, re.M) and re.search(r"^  report +\S+ +towerflow report ", out, re.M)
    records = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    points = {t: sum(1 for r in records if r["task"] == t and "loss" in r) for t in ("worker:0", "worker:1")}
    assert min(points.values()) >= 50, points  # 200 steps per worker here; the full demo gives ~350 each
    assert any("staleness" in r for r in records)
    for name in ("dashboard.png", "loss_vs_step.png", "loss_vs_time.png", "throughput.png", "staleness.png", "report.md"):
        assert (logdir / "report" / name).exists(), name
