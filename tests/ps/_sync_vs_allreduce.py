"""Run by tests/ps/test_sync_vs_allreduce.py under `towerflow launch --ps 1 --workers 2`.

The same two worker processes train the same float64 model on the same data twice:
  1. ParameterServerStrategy(mode="sync", replicas_to_aggregate=2): variables and SGD on the ps;
  2. MultiWorkerMirroredStrategy over gloo (the launcher's RANK / WORLD_SIZE / MASTER_* give the
     two workers a process group; the ps task is not in it): DDP all-reduce, SGD on each worker.
Both read their batches through `strategy.distribute_loader(global_batch_size=...)`, so worker i
gets the same shard of the same global batch in both runs. The chief saves both final
parameter sets to OUT/params.pt.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import towerflow

STEPS = 6
GLOBAL_BATCH = 16


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(96, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (96,), generator=g))


def train(strategy) -> torch.nn.Module:
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = strategy.setup(model, optimizer)
    loader = strategy.distribute_loader(dataset(), global_batch_size=GLOBAL_BATCH, seed=3)
    for _, (x, y) in zip(range(STEPS), loader.forever()):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args, _ = p.parse_known_args()

    ps = towerflow.ParameterServerStrategy(mode="sync", replicas_to_aggregate=2)  # a ps task serves here, then exits
    train(ps)
    results = {}
    if ps.is_chief:
        ps.wait_for_workers(refresh=False)
        results["ps_sync"] = ps.variables()
        results["ps_global_step"] = ps.global_step
        results["ps_links"] = ps.metrics()["links"]
    else:
        ps.finish()

    allreduce = towerflow.MultiWorkerMirroredStrategy()
    model = train(allreduce)
    if allreduce.is_chief:
        results["allreduce"] = {k: v.detach().clone() for k, v in allreduce.unwrap(model).named_parameters()}
        results["replicas"] = [ps.num_replicas_in_sync, allreduce.num_replicas_in_sync]
        torch.save(results, os.path.join(args.out, "params.pt"))
    allreduce.shutdown()
    ps.shutdown()


if __name__ == "__main__":
    main()
