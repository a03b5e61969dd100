"""A replica's data loader: its shard of every global batch, prefetched onto its device.

Built by `Strategy.distribute_loader`. A `TensorDataset` is indexed directly (one gather per
tensor per step, no per-sample collate); any other map-style dataset goes through a torch
`DataLoader` driven by the shard plan, so `num_workers` and `collate_fn` work as usual.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from towerflow.data.batch_facts import BatchFacts, attach
from towerflow.data.prefetch import DevicePrefetcher, _map_tensors
from towerflow.data.sharding import ShardBatch, ShardSampler


class DistributedLoader:
    """Iterates one replica's batches for the current epoch; `set_epoch(e)` reshuffles.

    Every batch carries its `BatchFacts` (`towerflow.batch_facts(batch)`): its local and global
    sizes and the loss weight `weigh` gives it, which `towerflow.train_step` applies to uneven tails.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: ShardSampler,
        device: torch.device,
        device_name: str = "",
        num_workers: int = 0,
        collate_fn: Optional[Callable] = None,
        pin_memory: bool = True,
        weigh: Optional[Callable[[ShardBatch], float]] = None,
    ):
        self.dataset = dataset
        self.sampler = sampler
        self.device = device
        self.device_name = device_name
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory and device.type == "cuda"
        self.weigh = weigh or (lambda batch: 1.0)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def global_batch_size(self) -> int:
        return self.sampler.global_batch_size

    def _gather(self, tensor: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Rows `idx` of `tensor`; straight into pinned memory when batches go to a GPU (one host copy, not two)."""
        if not self.pin_memory:
            return tensor[idx]
        out = torch.empty((len(idx), *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=True)
        return torch.index_select(tensor, 0, idx, out=out)

    def _host_batches(self, plan: List[ShardBatch]) -> Iterator[Any]:
        if isinstance(self.dataset, TensorDataset) and self.num_workers == 0:
            for b in plan:
                idx = torch.tensor(b.indices, dtype=torch.long)
                yield tuple(self._gather(t, idx) for t in self.dataset.tensors)
            return
        # DataLoader cannot collate an empty list: fetch one sample and cut it to zero rows.
        lists = [list(b.indices) or [0] for b in plan]
        loader = DataLoader(
            self.dataset,
            batch_sampler=lists,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            pin_memory=self.pin_memory,
        )
        for b, batch in zip(plan, loader):
            yield batch if b.indices else _map_tensors(batch, lambda t: t[:0])

    def __iter__(self) -> Iterator[Any]:
        plan = list(self.sampler.batches())
        batches = DevicePrefetcher(self._host_batches(plan), self.device, self.device_name, self.pin_memory)
        for position, (b, batch) in enumerate(zip(plan, batches)):
            facts = BatchFacts(len(b.indices), b.global_size, self.weigh(b), position == len(plan) - 1)
            yield attach(batch, facts)

    def forever(self) -> Iterator[Any]:
        """Batches across epochs without end (epoch 0, 1, ...), for step-counted training loops."""
        epoch = self.sampler.epoch
        while True:
            self.set_epoch(epoch)
            yield from self
            epoch += 1
