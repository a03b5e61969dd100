"""`sparse_optimizer=` in one process: the same script line that trains tables on the ps trains them here
with the torch twin of the row optimizer (SparseAdam for SparseAdam, ...)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import towerflow
from towerflow.errors import ParameterServerError, StrategyError


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.EmbeddingBag(30, 4, mode="sum", sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.table(ids)).squeeze(1)


def _train(model, optimizer, steps=5):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 30, (8, 3), generator=g)
        optimizer.zero_grad()
        model(ids).pow(2).mean().backward()
        optimizer.step()


def test_sparse_adam_in_one_process_equals_torchs_sparse_adam_beside_adam():
    plain = Model()
    dense = torch.optim.Adam(plain.head.parameters(), lr=0.01)
    tables = torch.optim.SparseAdam(plain.table.parameters(), lr=0.02)
    _train(plain, type("Both", (), {"zero_grad": lambda s: (dense.zero_grad(), tables.zero_grad()),
                                    "step": lambda s: (dense.step(), tables.step())})())
    strategy = towerflow.OneDeviceStrategy("/cpu:0")
    model = Model()
    model, optimizer = strategy.setup(model, torch.optim.Adam(model.head.parameters(), lr=0.01),
                                      sparse_optimizer=towerflow.ps.SparseAdam(lr=0.02))
    _train(model, optimizer)
    assert torch.equal(model.table.weight, plain.table.weight) and torch.equal(model.head.weight, plain.head.weight)
    assert strategy.global_step == 5


def test_wrong_combinations_say_what_to_change():
    strategy = towerflow.OneDeviceStrategy("/cpu:0")
    model = Model()
    with pytest.raises(StrategyError, match="over the dense parameters only"):
        strategy.setup(model, torch.optim.Adam(model.parameters()), sparse_optimizer=towerflow.ps.SparseAdam())
    with pytest.raises(ParameterServerError, match="parameter servers only"):
        strategy.setup(model, torch.optim.Adam(model.head.parameters()), sparse_optimizer=towerflow.ps.FTRL(lr=0.1))
    dense_only = nn.Linear(2, 1)
    with pytest.raises(StrategyError, match="no table with sparse=True"):
        strategy.setup(dense_only, torch.optim.SGD(dense_only.parameters(), lr=0.1), sparse_optimizer=towerflow.ps.SparseSGD(0.1))


def test_state_an_optimizer_made_when_built_moves_with_the_model():
    """Adagrad makes its sums when built, on the parameters' device then; setup's move takes them along
    (on a GPU the step would otherwise mix devices). Parameters on the meta device with sums on the host
    stand in for a model moved to a GPU after its optimizer was built."""
    from towerflow.strategies._optimizer import move_state_to_params

    model = nn.Linear(3, 2, device="meta")
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    for p, state in optimizer.state.items():
        state["sum"] = torch.full(p.shape, 0.5)
    move_state_to_params(optimizer)
    states = [optimizer.state[p] for p in model.parameters()]
    assert all(s["sum"].device.type == "meta" and s["sum"].shape == p.shape for s, p in zip(states, model.parameters()))
    assert all(s["step"].device.type == "cpu" for s in states)  # step counters stay where torch keeps them
