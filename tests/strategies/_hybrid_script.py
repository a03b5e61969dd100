"""One user script, run by tests/strategies/test_hybrid.py in one process and as hybrid workers.

A small float64 click model: two fixed tables (`nn.EmbeddingBag(sparse=True)`), a `HashEmbedding`
whose rows start at zero (so the ps and one process start it alike), and dense layers. `train` is the
whole training loop; the strategy alone changes between the runs. Run as a script (under
`towerflow launch --ps 1 --workers 2`) it trains with ParameterServerStrategy(dense="allreduce",
mode="sync", replicas_to_aggregate=2) and the chief saves what it ended with to OUT/hybrid.pt.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import towerflow

STEPS = 6
GLOBAL_BATCH = 16
ROWS = 40
HASH_IDS = 1000  # the hash table's ids are drawn below this; its rows are read back for ids 0..HASH_IDS-1


class Clicks(nn.Module):
    """Built with values everywhere (the chief sends the tables' rows to the ps): the same start in every run."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, 4, mode="sum", sparse=True, dtype=torch.float64)
                                    for _ in range(2))
        self.hashed = towerflow.ps.HashEmbedding(4, mode="sum", init_std=0.0, dtype=torch.float64)
        self.dense = nn.Sequential(nn.Linear(3, 4), nn.Tanh()).double()
        self.top = nn.Linear(16, 1).double()

    def forward(self, x, cats, hashed):
        vectors = [self.dense(x), *(t(cats[:, i:i + 1]) for i, t in enumerate(self.tables)), self.hashed(hashed)]
        return self.top(torch.cat(vectors, 1)).squeeze(1)

    def dense_parameters(self):
        return [*self.dense.parameters(), *self.top.parameters()]


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = 96
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    cats = torch.randint(0, ROWS, (n, 2), generator=g)
    hashed = torch.randint(0, HASH_IDS, (n, 2), generator=g) * 7919  # sparse int64 ids
    return TensorDataset(x, cats, hashed, (torch.rand(n, generator=g) < 0.3).double())


def train(strategy):
    model = Clicks()
    optimizer = torch.optim.SGD(model.dense_parameters(), lr=0.1, momentum=0.9)
    model, optimizer = strategy.setup(model, optimizer, sparse_optimizer=towerflow.ps.SparseSGD(lr=0.5))
    loader = strategy.distribute_loader(dataset(), global_batch_size=GLOBAL_BATCH, seed=3)
    for _, (x, cats, hashed, y) in zip(range(STEPS), loader.forever()):
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(model(x, cats, hashed), y).backward()
        optimizer.step()
    return model


@torch.no_grad()
def ended_with(strategy, model) -> dict:
    """The dense parameters, the fixed tables and the hash table's rows of every id it may have seen."""
    module = strategy.unwrap(model)
    module.eval()
    out = {f"dense.{part}.{k}": v.detach().clone() for part in ("dense", "top")
           for k, v in getattr(module, part).named_parameters()}
    ids = torch.arange(HASH_IDS).unsqueeze(1) * 7919
    out["hashed"] = module.hashed(ids).clone()
    for i, table in enumerate(module.tables):
        out[f"tables.{i}"] = table(torch.arange(ROWS).unsqueeze(1)).clone()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args, _ = p.parse_known_args()
    strategy = towerflow.ParameterServerStrategy(mode="sync", replicas_to_aggregate=2, dense="allreduce")
    model = train(strategy)
    if strategy.is_chief:
        strategy.wait_for_workers()
        got = ended_with(strategy, model)
        got["strategy"] = type(strategy).__name__
        got["global_step"] = strategy.global_step
        got["ps_metrics"] = strategy.ps_metrics()
        torch.save(got, os.path.join(args.out, "hybrid.pt"))
    strategy.shutdown()


if __name__ == "__main__":
    main()
