"""N replicas with per-replica batch b end with the parameters of one replica with batch N*b (SGD).

Replicas are N processes on this CPU, replica i on logical device /cpu:i (gloo all-reduce); the
same N devices as towers of one process (towers="threads") end with the DDP replicas' parameters.
"""

import os

import pytest
import torch

import towerflow
from _equivalence_worker import even, uneven
from _replicas import run_replicas

WORKER = os.path.join(os.path.dirname(__file__), "_equivalence_worker.py")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def _assert_same(got: dict, want: dict, what: str) -> None:
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-10, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("n", [2, 4])
def test_n_replicas_match_one_replica_with_n_times_the_batch(n, tmp_path):
    out = tmp_path / "params.pt"
    run_replicas([WORKER, str(out)], n, timeout=120)
    got = torch.load(out)

    one = towerflow.OneDeviceStrategy("/cpu:0")
    _assert_same(got["even"], even(one, per_replica_batch=4 * n), f"{n} replicas, even batches")
    one = towerflow.OneDeviceStrategy("/cpu:0")
    _assert_same(got["uneven"], uneven(one), f"{n} replicas, uneven tail + schedule + clipping")
    one = towerflow.OneDeviceStrategy("/cpu:0", variables_on="cpu")
    _assert_same(got["host"], even(one, per_replica_batch=4 * n), f"{n} replicas, variables on the CPU")

    # the same devices as towers of this one process (tests/strategies/test_towers.py) give what DDP gave
    devices = [f"/cpu:{i}" for i in range(n)]
    with towerflow.MirroredStrategy(devices=devices, towers="threads") as towers:
        _assert_same(even(towers, per_replica_batch=4), got["even"], f"{n} towers against {n} DDP replicas, even")
    with towerflow.MirroredStrategy(devices=devices, towers="threads") as towers:
        _assert_same(uneven(towers), got["uneven"], f"{n} towers against {n} DDP replicas, uneven")


def test_replicas_really_differ_from_a_smaller_batch(tmp_path):
    """Guards the test above: a wrong global batch would give different parameters."""
    one = towerflow.OneDeviceStrategy("/cpu:0")
    a = even(one, per_replica_batch=8)
    b = even(towerflow.OneDeviceStrategy("/cpu:0"), per_replica_batch=4)
    assert any(not torch.allclose(a[k], b[k]) for k in a)
