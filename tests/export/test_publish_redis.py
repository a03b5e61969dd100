"""Publishing to a real redis-server (`--publish-to redis://HOST:PORT/DB`): the rows a 2 ps + 2 worker job
publishes are in Redis, each under its key with its publication's number, equal to the final checkpoint's."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from _cluster_procs import ROOT, wait_until

redis = pytest.importorskip("redis")
pytest.importorskip("pyarrow")
HERE = Path(__file__).parent
TASK = str(HERE / "_train_task.py")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path):
    """A redis-server of its own on a free loopback port, in memory only; stopped after the test."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (tools/install_schedulers.sh installs it)")
    port = _free_port()
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              start_new_session=True)
    client = redis.Redis(host="127.0.0.1", port=port)

    def up():
        try:
            return client.ping()
        except redis.ConnectionError:
            return server.poll() is not None

    try:
        wait_until(up, 20, "redis-server to answer")
        assert server.poll() is None, "redis-server exited at start"
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.kill()
        server.wait(10)


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
