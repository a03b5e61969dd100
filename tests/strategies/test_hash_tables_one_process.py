"""A HashEmbedding in one process: the rows live in the process, trained and checkpointed with the model."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import towerflow
from towerflow.errors import StrategyError
from towerflow.ps import HashEmbedding, SparseAdagrad, SparseSGD

IDS = 10 ** 12  # ids far outside any fixed table


class Clicks(nn.Module):
    def __init__(self, **table):
        super().__init__()
        self.ids = HashEmbedding(4, mode="sum", **table)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.ids(ids))


class Table(nn.Module):
    def __init__(self, **table):
        super().__init__()
        self.ids = HashEmbedding(2, mode="sum", **table)

    def forward(self, ids):
        return self.ids(ids)


def _batch(step: int, size: int = 64):
    g = torch.Generator().manual_seed(step)
    ids = IDS + torch.randint(0, 50, (size, 3), generator=g)
    return ids, (ids % 2 == 0).sum(1).clamp(max=1)  # a label the ids decide


def _rows(strategy, ids):
    store = strategy.hash_tables.stores["ids"]
    return {int(i): store._values[store._slot_of.lookup(torch.tensor([i]))[0]].clone() for i in ids}


def test_a_hash_embedding_trains_in_one_process_with_the_row_optimizer():
    torch.manual_seed(0)
    strategy = towerflow.OneDeviceStrategy("/cpu:0")
    model = Clicks(admit_after=2)
    model, opt = strategy.setup(model, torch.optim.Adam(model.head.parameters(), lr=0.05),
                                sparse_optimizer=SparseAdagrad(lr=0.5))
    losses = []
    for step in range(150):
        x, y = _batch(step)
        losses.append(float(towerflow.train_step(strategy, model, opt, (x, y), F.cross_entropy)))
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    metrics = strategy.hash_tables.metrics()["ids"]
    assert metrics["rows"] == 50 and metrics["admitted"] == 50 and metrics["pending"] == 0


def test_one_step_updates_exactly_the_rows_it_looked_up_by_their_summed_gradient():
    strategy = towerflow.OneDeviceStrategy("/cpu:0")
    model, opt = strategy.setup(Table(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1),
                                sparse_optimizer=SparseSGD(lr=0.1))
    ids = torch.tensor([[5, 7], [5, 9]])
    model(ids)  # creates the rows (admit_after=1), no training step yet
    before = _rows(strategy, [5, 7, 9])
    opt.zero_grad()
    model(ids).sum().backward()  # d(sum)/d(row) = how often the row was looked up: 5 twice, 7 and 9 once
    opt.step()
    after = _rows(strategy, [5, 7, 9])
    for i, seen in ((5, 2), (7, 1), (9, 1)):
        assert torch.allclose(after[i], before[i] - 0.1 * seen), i
    assert strategy.global_step == 1 and strategy.hash_tables.steps == 1


def test_rows_untouched_for_evict_after_steps_go_as_on_the_ps():
    strategy = towerflow.OneDeviceStrategy("/cpu:0")
    model, opt = strategy.setup(Table(evict_after=2), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1),
                                sparse_optimizer=SparseSGD(lr=0.1))
    seen = []
    for ids in ([[1, 2]], [[2]], [[2]], [[2]]):  # 1 is looked up at step 0 only
        opt.zero_grad()
        model(torch.tensor(ids)).sum().backward()
        opt.step()
        seen.append(strategy.hash_tables.metrics()["ids"]["rows"])
    assert seen == [2, 2, 1, 1]  # gone once untouched for 2 steps
    assert strategy.hash_tables.metrics()["ids"] == {"rows": 1, "admitted": 2, "evicted": 1, "pending": 0}


def test_the_rows_come_back_from_a_checkpoint_of_the_optimizer():
    def build():
        torch.manual_seed(0)
        strategy = towerflow.OneDeviceStrategy("/cpu:0")
        model = Clicks()
        model, opt = strategy.setup(model, torch.optim.SGD(model.head.parameters(), lr=0.1),
                                    sparse_optimizer=SparseSGD(lr=0.5))
        return strategy, model, opt

    strategy, model, opt = build()
    for step in range(5):
        towerflow.train_step(strategy, model, opt, _batch(step), F.cross_entropy)
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    x, _ = _batch(99)
    model.eval()
    want = model(x)
    _, restored, restored_opt = build()
    restored.load_state_dict(saved_model)
    restored_opt.load_state_dict(saved_opt)
    restored.eval()
    assert torch.equal(restored(x), want)


def test_towers_or_replicas_would_each_grow_a_vocabulary_and_are_refused():
    towers = towerflow.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    try:
        with pytest.raises(StrategyError, match=r"with 2 replicas: each replica would grow a vocabulary of its own"):
            towers.setup(Clicks(), None)
    finally:
        towers.shutdown()
    with pytest.raises(StrategyError, match="variables_on='cpu' is not supported"):
        towerflow.OneDeviceStrategy("/cpu:0", variables_on="cpu").setup(Clicks(), None)


def test_a_hash_embedding_called_before_setup_says_what_to_do():
    with pytest.raises(towerflow.ParameterServerError, match=r"call `model, optimizer = strategy.setup\(model, optimizer\)`"):
        Clicks()(torch.tensor([[1, 2]]))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_same_script_trains_its_hash_table_in_one_process_and_on_a_parameter_server():
    script = os.path.join(os.path.dirname(__file__), "_hash_script.py")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TF_CONFIG", "TOWERFLOW_DEVICE")}
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])  # keep where packages are
    runs = {
        "one process": [sys.executable, script],
        "ps": [sys.executable, "-m", "towerflow", "launch", "--ps", "1", "--workers", "1", script],
    }
    seen = {}
    for name, cmd in runs.items():
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, f"{name}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        got = re.search(r"(\w+Strategy): loss ([\d.]+) -> ([\d.]+)", done.stdout)
        assert got, f"{name}: {done.stdout[-2000:]}"
        seen[name] = got.group(1)
        assert float(got.group(3)) < 0.5 * float(got.group(2)), got.group(0)
    assert seen == {"one process": "OneDeviceStrategy", "ps": "ParameterServerStrategy"}
