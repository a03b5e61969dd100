"""Which optimizers the ps tasks can run: the elementwise ones.

An update of a flat buffer is, element for element, the update a local optimizer makes to each
variable only when the optimizer is elementwise: the update of each element depends on that
element's history alone. So only those run on the ps. The worker checks it before it sends anything,
the ps again when it builds the optimizer.
"""

from __future__ import annotations

from typing import Type

import torch

from towerflow.errors import ParameterServerError

# Elementwise optimizers: the update of each element depends only on that element's history.
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adagrad", "Adam", "AdamW", "Adamax", "Adadelta", "RMSprop", "NAdam", "RAdam", "ASGD")


def check_optimizer(cls: Type[torch.optim.Optimizer]) -> None:
    """Refuse optimizers whose update of an element depends on other elements (LBFGS, Rprop-like norms)."""
    name = getattr(cls, "__name__", repr(cls))
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or name not in ELEMENTWISE_OPTIMIZERS:
        raise ParameterServerError(
            f"optimizer {name!r} cannot run on parameter servers: the ps applies updates shard by shard, which is exact "
            f"only for elementwise optimizers; use one of {', '.join(ELEMENTWISE_OPTIMIZERS)} from torch.optim"
        )
