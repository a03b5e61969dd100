"""What a loader knows of each batch it hands out, carried by the batch itself.

A replica's share of an uneven global batch decides how its loss is weighted, and that is a fact
of the batch, not of the strategy: a script that holds a training batch while it runs an
evaluation loader, or that accumulates several batches before a step, must still weigh each one
by its own share. The loader attaches a `BatchFacts` to every tensor of the batch (a tensor takes
attributes, whatever structure holds it: tuple, namedtuple, list or dict); `batch_facts(batch)`
reads it back, and `train_step` passes it on to the loss it returns, for `Progress`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import torch

_ATTRIBUTE = "_towerflow_batch_facts"


@dataclasses.dataclass(frozen=True)
class BatchFacts:
    """One replica's batch: its size, the global batch's size, its loss weight, and its place in the epoch.

    `weight` makes the replicas' averaged gradient the mean over the global batch: a synchronous
    replica with fewer samples than its peers counts for less (local × shards / global), a
    parameter-server worker's gradient is its own batch's mean (1.0).
    """

    local_size: int
    global_size: int
    weight: float
    is_last: bool  # the last batch of its epoch

    @property
    def is_empty(self) -> bool:
        """No samples for this replica (a tail shorter than the replicas): it still steps, with a zero loss."""
        return self.local_size == 0


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from _tensors(item)
    elif isinstance(batch, dict):
        for item in batch.values():
            yield from _tensors(item)


def attach(batch: Any, facts: Optional[BatchFacts]) -> Any:
    """`batch` itself, its tensors carrying `facts` (a batch without tensors carries none)."""
    if facts is not None:
        for tensor in _tensors(batch):
            setattr(tensor, _ATTRIBUTE, facts)
    return batch


def batch_facts(batch: Any) -> Optional[BatchFacts]:
    """The facts of a batch a strategy's loader handed out (or of the loss `train_step` returned for it);
    None for a batch built some other way, which is then a whole batch of its own."""
    for tensor in _tensors(batch):
        facts = getattr(tensor, _ATTRIBUTE, None)
        if facts is not None:
            return facts
    return None
