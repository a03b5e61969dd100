"""Deterministic per-replica sharding of a dataset into synchronous steps.

Every replica computes the same epoch order (a permutation seeded by `seed + epoch`), cuts it
into global batches, and takes its own contiguous slice of each one. So, across replicas,
every sample is used exactly once per epoch (no padding by repetition, unlike
`torch.utils.data.DistributedSampler`), all replicas run the same number of steps (a
synchronous all-reduce needs that), and per-replica batch sizes differ by at most one on an
uneven tail. A tail smaller than the replica count leaves some replicas an empty batch;
`towerflow.train_step` weights the loss so the update is still the mean over the global batch.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, List, Tuple

import torch

from towerflow.errors import DataError


@dataclasses.dataclass(frozen=True)
class ShardBatch:
    """One replica's indices for one step, and the size of the global batch they belong to."""

    indices: Tuple[int, ...]
    global_size: int


def _slice_bounds(size: int, num_replicas: int, replica_id: int) -> Tuple[int, int]:
    base, extra = divmod(size, num_replicas)
    start = replica_id * base + min(replica_id, extra)
    return start, start + base + (1 if replica_id < extra else 0)


class ShardSampler:
    """The batches one replica reads in one epoch; call `set_epoch` to reshuffle."""

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        num_replicas: int = 1,
        replica_id: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        if dataset_size < 0:
            raise DataError(f"dataset_size={dataset_size!r}: expected a non-negative number of samples")
        if num_replicas < 1 or not 0 <= replica_id < num_replicas:
            raise DataError(
                f"replica_id={replica_id!r} with num_replicas={num_replicas!r}: expected 0 <= replica_id < num_replicas"
            )
        if global_batch_size < num_replicas:
            raise DataError(
                f"global_batch_size={global_batch_size!r} is smaller than the {num_replicas} replicas: every replica "
                "needs at least one sample per step. Raise the batch size or use fewer replicas."
            )
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.num_replicas = num_replicas
        self.replica_id = replica_id
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Pick the epoch whose order to produce; every replica must use the same one."""
        self.epoch = epoch

    def _order(self) -> List[int]:
        if not self.shuffle:
            return list(range(self.dataset_size))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=g).tolist()

    def __len__(self) -> int:
        full, tail = divmod(self.dataset_size, self.global_batch_size)
        return full + (1 if tail and not self.drop_last else 0)

    def batches(self) -> Iterator[ShardBatch]:
        order = self._order()
        for step in range(len(self)):
            chunk = order[step * self.global_batch_size : (step + 1) * self.global_batch_size]
            start, stop = _slice_bounds(len(chunk), self.num_replicas, self.replica_id)
            yield ShardBatch(tuple(chunk[start:stop]), len(chunk))

    def __iter__(self) -> Iterator[List[int]]:
        """Index lists, so the sampler also works as a DataLoader `batch_sampler`."""
        for b in self.batches():
            yield list(b.indices)
