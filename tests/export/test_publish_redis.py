"""Publishing to a real redis-server (`--publish-to redis://HOST:PORT/DB`): the rows a 2 ps + 2 worker job
publishes are in Redis, each under its key with its publication's number, equal to the final checkpoint's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _cluster_procs import ROOT

redis = pytest.importorskip("redis")
pytest.importorskip("pyarrow")
HERE = Path(__file__).parent
TASK = str(HERE / "_train_task.py")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_the_rows_published_to_redis_end_equal_to_the_final_checkpoint(launcher, tmp_path, redis_url):
    from towerflow.serving import RedisRows

    logdir = tmp_path / "run"
    run = launcher.python("-m", "towerflow", "launch", "--ps", "2", "--workers", "2", "--logdir", str(logdir),
                          "--publish-every", "0.3", "--publish-to", redis_url, TASK, "--logdir", str(logdir), "--hash",
                          "--steps", "60", env={"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE)])})
    assert run.wait(120) == 0, run.describe()
    export = launcher.python("-m", "towerflow", "export", str(logdir), "--out", str(tmp_path / "out"), label="export")
    assert export.wait(60) == 0, export.describe()
    final = torch.load(tmp_path / "out" / "model.pt")
    hashed = torch.load(tmp_path / "out" / "hash_tables.pt")["hashed"]

    rows = RedisRows(redis_url)
    published = [rows.published(task) for task in (0, 1)]
    assert all(p is not None and p["global_step"] == 120 for p in published), published
    emb, versions = rows.lookup("emb", torch.arange(final["emb.weight"].shape[0]), 8)
    assert torch.equal(emb, final["emb.weight"])
    assert int(versions.min()) >= 1 and int(versions.max()) <= max(p["seq"] for p in published)
    got, _ = rows.lookup("hashed", hashed["ids"], 8)
    assert torch.equal(got, hashed["weight"])
    missing, version = rows.lookup("hashed", torch.tensor([-1]), 8)
    assert torch.equal(missing, torch.zeros(1, 8)) and version.tolist() == [0]
