"""Process fixtures for cluster tests: every started process is killed, its output shown on failure."""

from __future__ import annotations

import pytest

from _cluster_procs import Procs


@pytest.fixture
def procs(tmp_path, request):
    """Start processes; on teardown kill their process groups, and show their output if the test failed."""
    ps = Procs(tmp_path)
    yield ps
    for p in ps.started:
        p.kill_group()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(ps.describe())  # shown by pytest under "Captured stdout teardown"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
