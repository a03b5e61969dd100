"""`HashEmbedding`: an embedding table keyed by arbitrary int64 ids, whose vocabulary grows on the ps.

Monolith / DeepRec's dynamic embeddings for towerflow: no row count is fixed in advance. An id
gets a row on the ps task `id mod P` once it has been seen `admit_after` times (before that it
reads the default row, zeros, and learns nothing); a row untouched for `evict_after` global steps
is removed; with `forget_after`, an id unseen for that many global steps before it was admitted
starts its count over, which bounds what the ps remembers of ids seen too rarely to be admitted.
The module holds no rows itself: under `ParameterServerStrategy.setup` its calls go through the
ps like any other table's (`ps/worker/lookups.py`); under a one-process strategy's `setup` the same store
is held in the process (`strategies/_hash_tables.py`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from towerflow.errors import ParameterServerError


class HashEmbedding(nn.Module):
    """A growing table: `mode=None` looks up one row per id (like nn.Embedding), 'sum' / 'mean' / 'max'
    reduce bags (like nn.EmbeddingBag, input 2-D or 1-D with offsets)."""

    is_hash_table = True

    def __init__(self, embedding_dim: int, mode: Optional[str] = "sum", init_std: float = 0.01, admit_after: int = 1,
                 evict_after: Optional[int] = None, dtype: torch.dtype = torch.float32,
                 forget_after: Optional[int] = None):
        super().__init__()
        if not (isinstance(embedding_dim, int) and embedding_dim > 0):
            raise ParameterServerError(f"embedding_dim={embedding_dim!r}: expected a positive int")
        if mode not in (None, "sum", "mean", "max"):
            raise ParameterServerError(f"mode={mode!r}: expected None (one row per id), 'sum', 'mean' or 'max'")
        if not (isinstance(admit_after, int) and admit_after >= 1):
            raise ParameterServerError(f"admit_after={admit_after!r}: expected an int >= 1 (1: a row on first sight)")
        if evict_after is not None and not (isinstance(evict_after, int) and evict_after >= 1):
            raise ParameterServerError(f"evict_after={evict_after!r}: expected None (never) or an int >= 1 (global steps)")
        if forget_after is not None and not (isinstance(forget_after, int) and forget_after >= 1):
            raise ParameterServerError(
                f"forget_after={forget_after!r}: expected None (sightings kept until the id is admitted) or an int >= 1 "
                "(global steps an id may go unseen before its count of sightings starts over)"
            )
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.init_std = float(init_std)
        self.admit_after = admit_after
        self.evict_after = evict_after
        self.forget_after = forget_after
        self.dtype = dtype
        self.include_last_offset = False

    def forward(self, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise ParameterServerError(
            "a HashEmbedding holds no rows until a strategy's setup gives it some: call "
            "`model, optimizer = strategy.setup(model, optimizer)` first (the rows then live on the ps tasks under "
            "ParameterServerStrategy, in this process under one-process strategies)")

    def extra_repr(self) -> str:
        return (f"{self.embedding_dim}, mode={self.mode!r}, admit_after={self.admit_after}, "
                f"evict_after={self.evict_after}")
