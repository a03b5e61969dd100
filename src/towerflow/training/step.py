"""`train_step`: one synchronous step for the common (inputs, targets) -> loss case."""

from __future__ import annotations

from typing import Any, Callable

import torch

from towerflow.data.batch_facts import attach, batch_facts


def train_step(strategy, model: torch.nn.Module, optimizer, batch: Any, loss_fn: Callable) -> torch.Tensor:
    """zero_grad, forward (under the strategy's autocast), backward, step; returns the local loss.

    The loss is weighted by this replica's share of the global batch (the batch's own facts, as
    its loader recorded them), so an uneven tail (replicas with different batch sizes, even an
    empty one) still yields the mean gradient over the global batch, exactly as one replica
    reading the whole batch would. A batch from elsewhere counts as a whole batch. The returned
    loss carries the batch's facts, so `Progress.update(loss)` counts its samples.
    """
    facts = batch_facts(batch)
    inputs, targets = batch[0], batch[1]
    optimizer.zero_grad(set_to_none=True)
    with strategy.autocast():
        out = model(inputs)
        if facts is not None and facts.is_empty:
            loss = out.float().sum() * 0.0  # keeps every parameter in the graph so the all-reduce still runs
        else:
            loss = loss_fn(out, targets)
    weight = facts.weight if facts is not None else 1.0
    strategy.backward(loss * weight if weight != 1.0 else loss)
    optimizer.step()
    return attach(loss.detach(), facts)
