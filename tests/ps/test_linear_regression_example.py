"""The seed's example 4 under `towerflow launch --ps 1 --workers 2`: w and b end near 2 and 0.2."""

from __future__ import annotations

import os
import re

import pytest

from _launch import REPO, launch, run_by_hand


pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def test_linear_regression_on_one_ps_and_two_workers():
    text = launch(["--ps", "1", "--workers", "2", os.path.join(REPO, "examples", "linear_regression_ps.py")], timeout=180)
    for i in (0, 1):
        assert re.search(rf"Partial result from node: {i}, w: -?\d+\.\d+, b: -?\d+\.\d+", text), text[-3000:]
    final = re.search(r"final: w: (-?\d+\.\d+), b: (-?\d+\.\d+)", text)
    assert final, text[-3000:]
    w, b = float(final.group(1)), float(final.group(2))
    assert abs(w - 2) < 0.1 and abs(b - 0.2) < 0.1, (w, b)


def test_linear_regression_by_hand_with_the_seeds_flags(free_ports):
    ps, w0, w1 = free_ports(3)
    flags = ["--ps_hosts", f"localhost:{ps}", "--worker_hosts", f"localhost:{w0},localhost:{w1}"]
    outputs = run_by_hand(
        os.path.join(REPO, "examples", "linear_regression_ps.py"), [("ps", 0), ("worker", 1), ("worker", 0)],
        flags, ["--epochs", "2"], timeout=150,
    )
    for i in (0, 1):
        assert len(re.findall(rf"Partial result from node: {i}, w: ", outputs[f"worker:{i}"])) == 2
    assert "final: w: " in outputs["worker:0"]
