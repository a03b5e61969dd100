"""A model trained on 2 ps + 2 workers (a fixed table, a hash table, row-sharded dense variables), exported with
`towerflow export`, predicts in a fresh process without towerflow exactly what the live job's chief predicted; the
same checkpoint restored onto 1 and onto 3 ps tasks exports the same tables."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _cluster_procs import Procs

HERE = Path(__file__).parent
TASK = str(HERE / "_train_task.py")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
pytest.importorskip("pyarrow")


def _launch(procs: Procs, num_ps: int, workers: int, logdir: Path, *args: str) -> None:
    run = procs.python("-m", "towerflow", "launch", "--ps", str(num_ps), "--workers", str(workers), TASK,
                       "--logdir", str(logdir), *args, label=f"{logdir.name}-launch",
                       env={"PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE)])})
    assert run.wait(120) == 0, run.describe()


def _export(procs: Procs, run_dir: Path, out: Path) -> None:
    run = procs.python("-m", "towerflow", "export", str(run_dir), "--out", str(out), label=f"{out.name}-export")
    assert run.wait(60) == 0, run.describe()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 2 ps + 2 workers, 20 steps each, with its export."""
    tmp = tmp_path_factory.mktemp("export")
    procs = Procs(tmp)
    try:
        _launch(procs, 2, 2, tmp / "run2", "--hash", "--partition", "64")
        _export(procs, tmp / "run2", tmp / "out2")
        yield tmp, procs
    finally:
        for p in procs.started:
            p.kill_group()


def test_the_export_predicts_in_plain_pytorch_what_the_live_chief_predicted(trained):
    tmp, procs = trained
    plain = procs.python(str(HERE / "_predict_plain.py"), str(tmp / "out2"), str(tmp / "plain.pt"), "--hash",
                         label="plain", env={"PYTHONPATH": str(HERE)})  # towerflow's src is not even on the path
    assert plain.wait(60) == 0, plain.describe()
    assert "towerflow imported: no" in plain.out
    live = torch.load(tmp / "run2" / "predictions.pt")
    exported = torch.load(tmp / "plain.pt")
    assert live.shape == (300,) and live.std() > 0.1  # trained, and not constant
    torch.testing.assert_close(exported, live, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("num_ps", [1, 3])
def test_the_checkpoint_restored_onto_another_number_of_ps_tasks_exports_the_same_tables(trained, num_ps):
    tmp, procs = trained
    run = tmp / f"run{num_ps}"
    _launch(procs, num_ps, 1, run, "--hash", "--partition", "64", "--steps", "0", "--restore-from", str(tmp / "run2"))
    _export(procs, run, tmp / f"out{num_ps}")
    want = torch.load(tmp / "out2" / "model.pt")
    got = torch.load(tmp / f"out{num_ps}" / "model.pt")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    want_hash = torch.load(tmp / "out2" / "hash_tables.pt")["hashed"]
    got_hash = torch.load(tmp / f"out{num_ps}" / "hash_tables.pt")["hashed"]
    assert torch.equal(got_hash["ids"], want_hash["ids"]) and torch.equal(got_hash["weight"], want_hash["weight"])
    assert len(os.listdir(tmp / f"out{num_ps}" / "tables" / "emb")) == num_ps
