"""Data: deterministic per-replica sharding, prefetch to device, the shared MNIST loader, synthetic CTR data,
and click logs streamed from files by a schema of their features."""

from towerflow.data.batch_facts import BatchFacts, batch_facts
from towerflow.data.ctr import SyntheticCTR, auc, synthetic_ctr
from towerflow.data.ctr_files import write_ctr_files
from towerflow.data.features import Features
from towerflow.data.file_regroup import Handover
from towerflow.data.file_stream import FileStream, read_all
from towerflow.data.loader import DistributedLoader
from towerflow.data.mnist import Split, load_digits_split, load_mnist_or_digits, load_mnist_t10k, read_idx
from towerflow.data.prefetch import DevicePrefetcher, copy_to_device
from towerflow.data.schema import Categorical, CategoricalList, Dense, Schema, TextLayout
from towerflow.data.sharding import ShardBatch, ShardSampler

__all__ = [
    "Categorical",
    "CategoricalList",
    "Dense",
    "Features",
    "Schema",
    "TextLayout",
    "BatchFacts",
    "batch_facts",
    "DevicePrefetcher",
    "FileStream",
    "Handover",
    "read_all",
    "write_ctr_files",
    "DistributedLoader",
    "ShardBatch",
    "ShardSampler",
    "SyntheticCTR",
    "auc",
    "Split",
    "copy_to_device",
    "load_digits_split",
    "load_mnist_or_digits",
    "load_mnist_t10k",
    "read_idx",
    "synthetic_ctr",
]
