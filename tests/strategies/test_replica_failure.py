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


def test_a_replica_whose_first_rank_never_comes_gives_up_with_one_named_error(free_ports, tmp_path):
    """No C++ stack trace before towerflow's message: the store is reached only once something listens."""
    import subprocess
    import sys

    (port,) = free_ports(1)  # held, never listened on: rank 0 never comes
    script = tmp_path / "lonely.py"
    script.write_text("import towerflow\ntowerflow.strategy_from_env()\n")
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src"), "RANK": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TOWERFLOW_JOIN_TIMEOUT": "2"}
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and time.monotonic() - started < 30
    assert f"rank 1 gave up after 2 s: the first replica rank 0 (its process group at 127.0.0.1:{port}) never answered" \
        in out.stderr, out.stderr[-3000:]
    assert "frame #0" not in out.stderr and "Exception raised from" not in out.stderr, out.stderr[-3000:]
