"""`train_step`: one synchronous step for the common (inputs, targets) -> loss case."""

from __future__ import annotations

from typing import Any, Callable

import torch


def train_step(strategy, model: torch.nn.Module, optimizer, batch: Any, loss_fn: Callable) -> torch.Tensor:
    """zero_grad, forward (under the strategy's autocast), backward, step; returns the local loss.

    The loss is weighted by this replica's share of the global batch, so an uneven tail
    (replicas with different batch sizes, even an empty one) still yields the mean gradient
    over the global batch, exactly as one replica reading the whole batch would.
    """
    inputs, targets = batch[0], batch[1]
    optimizer.zero_grad(set_to_none=True)
    with strategy.autocast():
        out = model(inputs)
        if strategy.is_batch_empty:
            loss = out.float().sum() * 0.0  # keeps every parameter in the graph so the all-reduce still runs
        else:
            loss = loss_fn(out, targets)
    weighted = loss * strategy.batch_weight if strategy.batch_weight != 1.0 else loss
    strategy.backward(weighted)
    optimizer.step()
    return loss.detach()
