"""Reproducible runs: one seed for Python, NumPy and torch, the same on every replica."""

from __future__ import annotations

import random

import numpy as np
import torch

from towerflow import library_env as _library_env


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed every generator the same on all replicas (so the initial model is identical everywhere).

    Data order needs no per-replica seed: the sharded loader derives it from its own `seed`
    and the epoch. `deterministic=True` also asks torch for deterministic kernels.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    _library_env.set_default("PYTHONHASHSEED", str(seed))  # for the processes this one starts
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        _library_env.set_default("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
