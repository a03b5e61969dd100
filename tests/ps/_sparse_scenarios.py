"""Run by tests/ps/test_sparse_tables.py under `towerflow launch --ps 2 --workers 2`: models with embedding
tables on the ps tasks, one per scenario, trained one after another on the same cluster.

Every worker writes OUT/worker-<i>.json (its metrics and the ids it looked up per step); the chief
also writes OUT/chief.json (the final dense variables, table values and ps counters per scenario).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import towerflow
from _cluster_scenarios import write_results

STEPS = 6
USERS, ITEMS, DIM = 50, 40, 3


class Tiny(nn.Module):
    """One nn.Embedding and one nn.EmbeddingBag table (sparse=True), and a dense head."""

    def __init__(self, table_device=None):
        super().__init__()
        torch.manual_seed(0)
        self.user = nn.Embedding(USERS, DIM, sparse=True, device=table_device)
        self.items = nn.EmbeddingBag(ITEMS, DIM, mode="mean", sparse=True, device=table_device)
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, users, items, offsets):
        return self.head(torch.cat([self.user(users), self.items(items, offsets)], 1)).squeeze(1)


class Hashed(nn.Module):
    def __init__(self, admit_after, evict_after):
        super().__init__()
        self.ids = towerflow.ps.HashEmbedding(DIM, mode="sum", admit_after=admit_after, evict_after=evict_after)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids, offsets):
        return self.head(self.ids(ids, offsets)).squeeze(1)


def batch(step: int, worker: int):
    """Four samples; ids repeat within and across workers (so gradients of one row add up)."""
    g = torch.Generator().manual_seed(100 * step + worker)
    users = torch.randint(0, USERS, (4,), generator=g)
    items = torch.randint(0, ITEMS, (7,), generator=g)
    offsets = torch.tensor([0, 2, 3, 5])
    target = torch.randn(4, generator=g)
    return users, items, offsets, target


BASE = 10 ** 12


def hashed_batch(step: int, worker: int):
    """Ids far outside any fixed range (tests/ps/test_sparse_tables.py counts what each one does)."""
    if worker == 0:
        ids = [BASE + step % 3, -BASE, BASE + 1000 * step]
    elif step < 2:
        ids = [-BASE - 1, 7 * BASE + step]
    else:
        ids = [7 * BASE + step, 7 * BASE + step + 100]
    return torch.tensor(ids), torch.tensor([0, 1])


def train_tiny(strategy, model, optimizer, looked_up):
    for step in range(STEPS):
        users, items, offsets, target = batch(step, strategy.replica_id)
        looked_up.append({"user": torch.unique(users).numel(), "items": torch.unique(items).numel()})
        optimizer.zero_grad()
        nn.functional.mse_loss(model(users, items, offsets), target.to(strategy.device)).backward()  # ids: any device
        optimizer.step()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args, _ = p.parse_known_args()
    server = towerflow.Server()
    if server.job_name == "ps":
        server.join()
        return
    mine, chief = {}, {}
    scenarios = [
        ("sync_mod_adagrad", dict(mode="sync"), lambda m: torch.optim.Adagrad(m.parameters(), lr=0.3), None),
        ("sync_div_sgd", dict(mode="sync", partition_strategy="div"), lambda m: torch.optim.SGD(m.parameters(), lr=0.5),
         None),
        ("async_adam_meta", dict(mode="async"), lambda m: torch.optim.Adam(m.parameters(), lr=0.01), "meta"),
    ]
    for name, options, make_optimizer, table_device in scenarios:
        strategy = towerflow.ParameterServerStrategy(server=server, model_name=name, **options)
        model = Tiny(table_device)
        model, optimizer = strategy.setup(model, make_optimizer(model))
        looked_up = []
        train_tiny(strategy, model, optimizer, looked_up)
        strategy.finish()
        mine[name] = {**strategy.metrics(), "looked_up": looked_up}
        if strategy.is_chief:
            chief[name] = {"global_step": strategy.wait_for_workers(),
                           "variables": {k: v.tolist() for k, v in strategy.variables().items()},
                           "tables": {k: v.tolist() for k, v in strategy.table_values().items()},
                           "ps": strategy.ps_metrics()}
    # a growing vocabulary: admitted on the 2nd sighting, evicted after 2 untouched global steps
    strategy = towerflow.ParameterServerStrategy(server=server, model_name="hash", mode="sync")
    model = Hashed(admit_after=2, evict_after=2)
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(4):
        ids, offsets = hashed_batch(step, strategy.replica_id)
        optimizer.zero_grad()
        model(ids, offsets).sum().backward()
        optimizer.step()
    strategy.finish()
    if strategy.is_chief:
        chief["hash"] = {"global_step": strategy.wait_for_workers(), "ps": strategy.ps_metrics()}
    write_results(args.out, strategy.replica_id, mine, chief)
    server.join()


if __name__ == "__main__":
    main()
