"""The seed's example 4 under `towerflow launch --ps 1 --workers 2`: w and b end near 2 and 0.2."""

from __future__ import annotations

import os
import re

import pytest

from _launch import REPO, launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(200)]


def test_linear_regression_on_one_ps_and_two_workers():
    text = launch(["--ps", "1", "--workers", "2", os.path.join(REPO, "examples", "linear_regression_ps.py")], timeout=180)
    for i in (0, 1):
        assert re.search(rf"Partial result from node: {i}, w: -?\d+\.\d+, b: -?\d+\.\d+", text), text[-3000:]
    final = re.search(r"final: w: (-?\d+\.\d+), b: (-?\d+\.\d+)", text)
    assert final, text[-3000:]
    w, b = float(final.group(1)), float(final.group(2))
    assert abs(w - 2) < 0.1 and abs(b - 0.2) < 0.1, (w, b)
