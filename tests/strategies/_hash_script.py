"""One script with a HashEmbedding, run as is in one process and under `towerflow launch --ps 1 --workers 1`
(tests/strategies/test_hash_tables_one_process.py): the same lines train either way."""

import torch
import torch.nn.functional as F
from torch import nn

import towerflow
from towerflow.ps import HashEmbedding, SparseAdagrad


class Clicks(nn.Module):
    def __init__(self):
        super().__init__()
        self.ids = HashEmbedding(4, mode="sum", admit_after=2)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.ids(ids))


def main():
    towerflow.set_seed(0)
    strategy = towerflow.strategy_from_env()
    model = Clicks()
    model, opt = strategy.setup(model, torch.optim.Adam(model.head.parameters(), lr=0.05),
                                sparse_optimizer=SparseAdagrad(lr=0.5))
    losses = []
    for step in range(120):
        g = torch.Generator().manual_seed(step)
        ids = 10 ** 12 + torch.randint(0, 50, (64, 3), generator=g)
        labels = (ids % 2 == 0).sum(1).clamp(max=1).to(strategy.device)  # the ids may stay on the host
        opt.zero_grad()
        loss = F.cross_entropy(model(ids), labels)
        strategy.backward(loss)
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"{type(strategy).__name__}: loss {first:.3f} -> {last:.3f}", flush=True)
    strategy.shutdown()


if __name__ == "__main__":
    main()
