"""The model of the export tests, in plain PyTorch (this file imports nothing of towerflow), and its records."""

from __future__ import annotations

import torch
from torch import nn

ROWS, DIM, DENSE = 200, 8, 5
HASH_POOL = torch.tensor([(i * 7919 + 3) * 1_000_003 for i in range(40)], dtype=torch.int64)  # ids far past any row count


class PlainNet(nn.Module):
    """A fixed table (EmbeddingBag), an optional hash-keyed table passed in (`hashed`), and an MLP."""

    def __init__(self, hashed=None, table_device=None):
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True, device=table_device)
        self.emb.init_std = 0.1
        self.hashed = hashed
        width = DENSE + DIM * (2 if hashed is not None else 1)
        self.mlp = nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense, ids, hash_ids):
        parts = [dense, self.emb(ids)]
        if self.hashed is not None:
            parts.append(self.hashed(hash_ids))
        return self.mlp(torch.cat(parts, 1)).squeeze(1)


def records(n: int, seed: int):
    """(dense, ids [n, 2], hash ids [n, 2], labels): ids from the table's rows and from the hash pool."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, DENSE, generator=g)
    ids = torch.randint(0, ROWS, (n, 2), generator=g)
    hash_ids = HASH_POOL[torch.randint(0, len(HASH_POOL), (n, 2), generator=g)]
    labels = ((dense[:, 0] + (ids[:, 0] % 3 == 0).float() - (hash_ids[:, 0] % 5 == 0).float()) > 0).float()
    return dense, ids, hash_ids, labels
