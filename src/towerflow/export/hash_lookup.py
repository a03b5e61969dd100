"""A hash table's exported rows looked up by id, in plain PyTorch: put it where the model had a `HashEmbedding`.

`towerflow export` copies this file into the export, so serving code loads it with no towerflow installed:

    import sys; sys.path.insert(0, EXPORT_DIR)
    from hash_lookup import HashTableLookup
    model = MyModel(hashed=HashTableLookup.load(EXPORT_DIR, "hashed", mode="sum"))   # the module's name and mode
    model.load_state_dict(torch.load(f"{EXPORT_DIR}/model.pt"))

An id the export does not hold reads a row of zeros, as an id not yet admitted reads during training.
This file imports only torch (the export copies it verbatim).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

HASH_TABLES_FILE = "hash_tables.pt"


class HashTableLookup(nn.Module):
    """Rows of sorted int64 `ids` in `weight`; `mode` None looks up one row per id (nn.Embedding), 'sum' /
    'mean' / 'max' reduce bags (nn.EmbeddingBag: 2-D input, or 1-D with offsets)."""

    def __init__(self, ids: torch.Tensor, weight: torch.Tensor, mode: Optional[str] = "sum"):
        super().__init__()
        if ids.dim() != 1 or weight.dim() != 2 or ids.numel() != weight.shape[0]:
            raise ValueError(f"HashTableLookup: {ids.numel()} ids for a weight of shape {tuple(weight.shape)}; "
                             "expected one row per id")
        order = torch.argsort(ids)
        # not in the model's state_dict: model.pt stays loadable by the user's model class as it is
        self.register_buffer("ids", ids[order].long(), persistent=False)
        zero = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        self.register_buffer("weight", torch.cat([weight[order], zero]), persistent=False)  # last row: unknown ids
        self.mode = mode

    @classmethod
    def load(cls, export_dir: str, name: str, mode: Optional[str] = "sum") -> "HashTableLookup":
        """The table `name` (its module's name in the trained model) of an export; `mode` as the
        `HashEmbedding` had it (the export does not know the module's mode)."""
        tables = torch.load(os.path.join(export_dir, HASH_TABLES_FILE), map_location="cpu")
        if name not in tables:
            raise KeyError(f"{export_dir} exports hash tables {sorted(tables)}, not {name!r}")
        entry = tables[name]
        return cls(entry["ids"], entry["weight"], mode)

    def rows(self, input: torch.Tensor) -> torch.Tensor:
        """The row of each id (the zero row for an id the table does not hold)."""
        n = self.ids.numel()
        flat = input.reshape(-1).long()
        at = torch.searchsorted(self.ids, flat).clamp_(max=max(n - 1, 0))
        found = self.ids[at] == flat if n else torch.zeros_like(flat, dtype=torch.bool)
        return torch.where(found, at, torch.full_like(at, n)).reshape(input.shape)

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows = self.rows(input)
        if self.mode is None:
            return F.embedding(rows, self.weight)
        return F.embedding_bag(rows, self.weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights)

    def extra_repr(self) -> str:
        return f"{self.ids.numel()} ids, dim={self.weight.shape[1]}, mode={self.mode!r}"
