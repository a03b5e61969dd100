"""The cluster's store lost for good (its one etcd member killed) under a running ps job with mirrored ps tasks and
restarts allowed: the job ends with an error that names the lost store, every task fails on its own and cleanly
(exit status 1: no crash in the interpreter's teardown with threads still inside torch and pyzmq), and a worker
stepping over a same-host link to a ps task that stops serving sees that ps task lost, not a failed call."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from _etcd import LocalEtcd, unavailable

pytestmark = pytest.mark.timeout(240)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAIN = """
import torch
from torch import nn
import towerflow
strategy = towerflow.strategy_from_env()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
step = 0
while True:  # until the job ends
    optimizer.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    step += 1
    if step % 100 == 0:
        print(f"trained {step}", flush=True)
"""


def _read(path) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def test_a_lost_store_ends_the_job_cleanly_with_its_reason(tmp_path, free_ports):
    if unavailable():
        pytest.skip(unavailable())
    etcd = LocalEtcd(1, free_ports(2))
    script, log = tmp_path / "train.py", tmp_path / "launch.log"
    script.write_text(TRAIN)
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src"))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "towerflow", "launch", "--ps", "2", "--workers", "2",
                                 "--ps-replicas", "2", "--max-restarts", "1", "--store", etcd.url, str(script)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "[worker:0] trained 300" not in _read(log):
            assert proc.poll() is None and time.monotonic() < deadline, _read(log)[-4000:]
            time.sleep(0.2)
        etcd.kill(0)
        proc.wait(180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        etcd.close()
    output = _read(log)
    assert proc.returncode != 0, output[-4000:]
    assert re.search(r"lost the cluster's store|no etcd member answered", output), output[-4000:]
    assert "Fatal Python error" not in output and "terminate called" not in output, output[-6000:]
    assert not re.search(r"killed by signal (6|11)\b", output), output[-6000:]
    assert "serves no endpoint" not in output, output[-6000:]
    for line in re.findall(r"\[worker:\d\] .*lost /job:ps/task:\d.*", output):  # seen as a ps task lost
        assert "waiting for its restart" in line, line
