"""`evaluate`: metrics over a sharded test set, summed across replicas, so every replica gets the total."""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch


@torch.no_grad()
def evaluate(strategy, model: torch.nn.Module, loader, loss_fn: Optional[Callable] = None) -> Dict[str, float]:
    """Accuracy (and mean loss with `loss_fn`) of a classifier over all replicas' shards.

    Runs the unwrapped module (no DDP forward, so shards of different sizes cannot hang),
    counts locally, then sums the counts with one all-reduce. Use a loader made with
    `shuffle=False`: shards then cover the test set exactly once.
    """
    module = strategy.unwrap(model)
    was_training = module.training
    module.eval()
    correct = total = loss_sum = 0.0
    for batch in loader:
        x, y = batch[0], batch[1]
        if len(y) == 0:
            continue
        with strategy.autocast():
            out = module(x)
        correct += (out.argmax(dim=1) == y).sum().item()
        total += len(y)
        if loss_fn is not None:
            loss_sum += float(loss_fn(out.float(), y)) * len(y)
    module.train(was_training)
    sums = strategy.reduce(torch.tensor([correct, total, loss_sum], dtype=torch.float64), op="sum")
    correct, total, loss_sum = sums.tolist()
    metrics = {"accuracy": correct / total if total else float("nan"), "samples": int(total)}
    if loss_fn is not None:
        metrics["loss"] = loss_sum / total if total else float("nan")
    return metrics
