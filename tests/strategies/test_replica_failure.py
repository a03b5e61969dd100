"""A replica that raises stops the whole job within seconds, and its error is what it reports."""

import os
import time

import pytest

from _replicas import REPO, run_replicas

SCRIPT = os.path.join(REPO, "examples", "mnist_sync.py")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


def test_failing_replica_stops_every_replica_and_the_survivor_names_it():
    start = time.monotonic()
    # kill_on_failure=False: the survivors must stop by themselves, not because a launcher killed them.
    results = run_replicas([SCRIPT, "--steps", "200", "--fail-at-step", "3"], 2, timeout=60, kill_on_failure=False,
                           check=False)
    assert time.monotonic() - start < 45, "the surviving replica waited on a collective instead of failing fast"
    failed, survivor = results[1], results[0]
    assert failed.returncode == 1, failed
    assert "towerflow: rank 1 failed:\nTraceback" in failed.stderr
    assert "RuntimeError: injected failure at step 3" in failed.stderr
    assert survivor.returncode not in (0, None), survivor  # it exited on its own, with an error
    # the survivor's gloo error is a consequence: one line, naming the replica that failed first
    assert ("towerflow: rank 0 stopped: lost a peer of its process group (gloo" in survivor.stderr
            and "(rank 1 failed first: RuntimeError: injected failure at step 3)" in survivor.stderr), survivor
    assert "Traceback" not in survivor.stderr, survivor
