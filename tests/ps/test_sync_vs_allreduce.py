"""Sync parameter servers with replicas_to_aggregate = workers train exactly as the all-reduce strategy.

One `towerflow launch --ps 1 --workers 2` of `_sync_vs_allreduce.py`: the two workers train the
same float64 model on the same global batches, first through the ps (mode="sync",
replicas_to_aggregate=2, SGD with momentum on the ps), then with MultiWorkerMirroredStrategy
(DDP over gloo, SGD on each worker). The final parameters must agree to 1e-10, with the ps steps going
over the same-host shared-memory link and over ZeroMQ calls.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SCRIPT = str(Path(__file__).parent / "_sync_vs_allreduce.py")


@pytest.mark.parametrize("link", ["shm", "zmq"])
def test_sync_with_every_replica_ends_with_the_all_reduce_strategy_parameters(launcher, tmp_path, link):
    """Through the same-host shared-memory link (the default on one host) and through ZeroMQ calls alike."""
    import _sync_vs_allreduce as script

    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", SCRIPT, "--out", str(tmp_path),
                          env={"OMP_NUM_THREADS": "1", "TOWERFLOW_PS_LINK": link}, label="launch")
    assert run.wait(90) == 0, launcher.describe()
    got = torch.load(tmp_path / "params.pt", map_location="cpu")
    assert got["replicas"] == [2, 2] and got["ps_global_step"] == script.STEPS
    assert got["ps_links"] == {"/job:ps/task:0": link}
    ps, allreduce = got["ps_sync"], got["allreduce"]
    assert sorted(ps) == sorted(allreduce) == sorted(n for n, _ in script.build_model().named_parameters())
    initial = dict(script.build_model().named_parameters())
    for name, value in allreduce.items():
        assert value.dtype == ps[name].dtype == torch.float64
        assert (value - initial[name]).abs().max() > 1e-3, f"{name} did not train"  # guards a vacuous comparison
        torch.testing.assert_close(ps[name], value, rtol=0, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
