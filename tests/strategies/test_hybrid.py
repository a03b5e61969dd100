"""Hybrid training (tables on the ps, dense layers all-reduced) trains exactly as one process does.

`_hybrid_script.py` is one user script: the test runs its loop in this process with OneDeviceStrategy, and
launches it as `towerflow launch --ps 1 --workers 2` with ParameterServerStrategy(dense="allreduce",
mode="sync", replicas_to_aggregate=2). On the same global batches, in float64, the dense layers, the fixed
tables and the hash table must end equal to 1e-10.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import towerflow

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]

SCRIPT = str(Path(__file__).parent / "_hybrid_script.py")


def test_sync_hybrid_with_every_worker_ends_with_the_one_process_values(launcher, tmp_path):
    import _hybrid_script as script

    run = launcher.python("-m", "towerflow", "launch", "--ps", "1", "--workers", "2", SCRIPT, "--out", str(tmp_path),
                          env={"OMP_NUM_THREADS": "1"}, label="launch")
    assert run.wait(120) == 0, launcher.describe()
    hybrid = torch.load(tmp_path / "hybrid.pt", map_location="cpu", weights_only=False)
    assert hybrid["strategy"] == "HybridStrategy" and hybrid["global_step"] == script.STEPS

    strategy = towerflow.OneDeviceStrategy(device="/cpu:0")
    model = script.train(strategy)
    alone = script.ended_with(strategy, model)
    initial = script.Clicks()
    assert sorted(k for k in hybrid if k.startswith(("dense.", "tables.", "hashed"))) == sorted(alone)
    for name, value in alone.items():
        assert hybrid[name].dtype == value.dtype == torch.float64
        torch.testing.assert_close(hybrid[name], value, rtol=0, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
    moved = {n: (alone[f"dense.{n}"] - p).abs().max().item() for n, p in initial.named_parameters()
             if f"dense.{n}" in alone}
    assert min(moved.values()) > 1e-4, f"a dense parameter did not train: {moved}"  # guards a vacuous comparison
    assert alone["hashed"].abs().sum() > 0 and (alone["tables.0"] - initial.tables[0].weight).abs().max() > 1e-4


def test_an_unknown_dense_place_is_refused_with_the_choices():
    with pytest.raises(towerflow.StrategyError, match=r"dense='mirrored'.*\('ps', 'allreduce'\)"):
        towerflow.ParameterServerStrategy(dense="mirrored")
