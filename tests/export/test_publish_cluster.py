"""Publishing on a running cluster: `towerflow launch --publish-every` makes 2 ps tasks publish while 2 workers
train, and the store built from their publications ends equal to the run's final checkpoint bit for bit; the CTR
example keeps publishing, with no gap in the numbers, after one of its ps tasks is killed and restarted."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch

from _cluster_procs import ROOT, wait_until
from towerflow import _files
from towerflow.ps.tables import delta_log
from towerflow.serving import EmbeddingStore

HERE = Path(__file__).parent
TASK = str(HERE / "_train_task.py")
CTR = str(ROOT / "examples" / "ctr_ps.py")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
pytest.importorskip("pyarrow")


def _seqs(publish: Path, task: int) -> list:
    return [(e.seq, e.kind) for e in delta_log.read_manifest(delta_log.task_dir(str(publish), "model", task))]


def test_the_published_rows_end_equal_to_the_final_checkpoint(launcher, tmp_path):
    logdir = tmp_path / "run"
    run = launcher.python("-m", "towerflow", "launch", "--ps", "2", "--workers", "2", "--logdir", str(logdir),
                          "--publish-every", "0.3", TASK, "--logdir", str(logdir), "--hash", "--steps", "60",
                          env={"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE)])})
    assert run.wait(120) == 0, run.describe()
    export = launcher.python("-m", "towerflow", "export", str(logdir), "--out", str(tmp_path / "out"), label="export")
    assert export.wait(60) == 0, export.describe()

    store = EmbeddingStore(str(logdir / _files.PUBLISH_SUBDIR))
    store.refresh()
    final = torch.load(tmp_path / "out" / "model.pt")
    hashed = torch.load(tmp_path / "out" / "hash_tables.pt")["hashed"]
    ids, rows = store.table("emb")
    assert torch.equal(ids, torch.arange(rows.shape[0])) and torch.equal(rows, final["emb.weight"])
    ids, rows = store.table("hashed")
    assert torch.equal(ids, hashed["ids"]) and torch.equal(rows, hashed["weight"])
    dense = store.dense()
    assert torch.equal(dense["mlp.0.weight"], final["mlp.0.weight"])
    for task in (0, 1):
        seqs = _seqs(logdir / _files.PUBLISH_SUBDIR, task)
        numbers = [s for s, _ in seqs]  # the oldest snapshots are pruned (two are kept): the rest has no gap
        assert seqs[0][1] == "snapshot" and numbers == list(range(numbers[0], numbers[0] + len(seqs))), seqs
        assert store.global_steps[task] == 120  # the last publication, at the end, holds the last steps


def test_a_killed_ps_task_publishes_on_after_its_restart_with_no_gap(launcher, tmp_path):
    logdir = tmp_path / "run"
    publish = logdir / _files.PUBLISH_SUBDIR
    run = launcher.python("-m", "towerflow", "launch", "--ps", "2", "--workers", "2", "--max-restarts", "1",
                          "--logdir", str(logdir), "--publish-every", "0.5", CTR, "--rows", "10000", "--steps", "600",
                          "--test-size", "5000", "--save-checkpoint-steps", "40")
    wait_until(lambda: "towerflow launch: started" in run.err, 30, "the launch to start its tasks")
    pid = int(re.search(r"/job:ps/task:1 \(pid (\d+)\)", run.err).group(1))
    wait_until(lambda: (len(_seqs(publish, 1)) >= 2 and any(logdir.glob("ckpt-*.json"))) or run.popen.poll() is not None,
               120, "two publications of ps:1 and a checkpoint")
    assert run.popen.poll() is None, run.describe()
    before = _seqs(publish, 1)
    assert before[0] == (1, "snapshot"), before
    os.kill(pid, signal.SIGKILL)
    assert run.wait(240) == 0, run.describe()
    assert "/job:ps/task:1: rejoined the cluster (restart 1)" in run.err, run.describe()

    seqs = _seqs(publish, 1)
    numbers = [s for s, _ in seqs]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), seqs  # no gap, across the restart
    restart = re.search(r"\[ps:1\] towerflow: /job:ps/task:1: published snapshot (\d+) of 'model' at global step \d+ "
                        r"\(its first", run.err[run.err.index("rejoined the cluster (restart 1)"):])
    assert restart and int(restart.group(1)) > before[-1][0], run.describe()  # its first publication is whole
    announced = {_files.publish_entry_dir(s, k) for s, k in seqs} | {_files.PUBLISH_MANIFEST}
    assert set(os.listdir(delta_log.task_dir(str(publish), "model", 1))) == announced  # nothing torn left behind
    store = EmbeddingStore(str(publish))
    assert store.refresh() > 0 and len(store.tables) == 26
