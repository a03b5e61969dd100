"""Data: deterministic per-replica sharding, prefetch to device, and the shared MNIST loader."""

from towerflow.data.loader import DistributedLoader
from towerflow.data.mnist import Split, load_digits_split, load_mnist_or_digits, load_mnist_t10k, read_idx
from towerflow.data.prefetch import DevicePrefetcher, copy_to_device
from towerflow.data.sharding import ShardBatch, ShardSampler

__all__ = [
    "DevicePrefetcher",
    "DistributedLoader",
    "ShardBatch",
    "ShardSampler",
    "Split",
    "copy_to_device",
    "load_digits_split",
    "load_mnist_or_digits",
    "load_mnist_t10k",
    "read_idx",
]
