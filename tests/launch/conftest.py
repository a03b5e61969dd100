"""Launcher tests reuse the cluster tests' process helpers (tests/cluster/_cluster_procs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "cluster"))

from _cluster_procs import Procs  # noqa: E402


@pytest.fixture
def launcher(tmp_path, request):
    """Start `towerflow launch` processes; kill their groups at teardown, show output on failure."""
    ps = Procs(tmp_path)
    yield ps
    for p in ps.started:
        p.kill_group()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(ps.describe())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
