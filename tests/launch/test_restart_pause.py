"""A task that fails soon after its start again and again (its host cut off from the others, a script that fails
at once) is restarted after a pause that doubles each time, so that it does not spend every restart in seconds;
one that ran a while is restarted at once, as is the first quick failure (a kill at a random moment)."""

from __future__ import annotations

import io
import re
import sys
import time

import pytest

from towerflow.launch import supervisor
from towerflow.launch.supervisor import Supervisor
from towerflow.launch.task_process import TaskProcessSpec

pytestmark = pytest.mark.timeout(60)


def _run(argv, monkeypatch, max_restarts=4, quick_s=5.0):
    monkeypatch.setattr(supervisor, "QUICK_FAILURE_S", quick_s)
    monkeypatch.setattr(supervisor, "BACKOFF_S", (0.2, 0.5))
    err = io.StringIO()
    started = time.monotonic()
    code = Supervisor([TaskProcessSpec("worker", 0, argv, {})], max_restarts=max_restarts, out=io.StringIO(),
                      err=err).run()
    return code, time.monotonic() - started, err.getvalue()


def test_a_task_that_fails_at_once_again_waits_longer_each_time(monkeypatch):
    code, took, err = _run([sys.executable, "-c", "import sys; sys.exit(3)"], monkeypatch)
    assert code == 3, err
    assert re.search(r"exited with code 3; restarting it \(1 of 4\) as pid \d+", err), err  # the first: at once
    pauses = [float(p) for p in re.findall(r"restarting it \(\d of 4\) in ([\d.]+) s: it failed within 5 s of its "
                                           r"start \d times in a row", err)]
    assert pauses == [0.2, 0.4, 0.5], err  # doubling, up to the cap
    assert len(re.findall(r"restarted /job:worker/task:0 \(\d of 4\) as pid \d+", err)) == 3, err
    assert took >= sum(pauses), err


def test_a_task_that_ran_a_while_is_restarted_at_once(monkeypatch):
    code, _, err = _run([sys.executable, "-c", "import sys, time; time.sleep(0.4); sys.exit(3)"], monkeypatch,
                        max_restarts=2, quick_s=0.3)
    assert code == 3 and " in 0." not in err, err
    assert len(re.findall(r"restarting it \(\d of 2\) as pid \d+", err)) == 2, err
