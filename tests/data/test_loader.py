"""The replica loader: shards of a dataset, on the replica's device, with the copies in the placement log."""

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import towerflow
from towerflow.data import DevicePrefetcher, DistributedLoader, ShardSampler, copy_to_device


class _ListDataset(Dataset):
    def __init__(self, n):
        self.items = [(torch.full((3,), float(i)), i) for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _loader(dataset, n=4, rank=3, size=7, batch=4, **kw):
    return DistributedLoader(dataset, ShardSampler(size, batch, n, rank, shuffle=False), torch.device("cpu"), **kw)


def test_tensor_and_generic_datasets_give_the_same_batches_including_an_empty_one():
    tensors = TensorDataset(torch.arange(7.0).repeat(3, 1).T, torch.arange(7))
    a = [tuple(t.tolist() for t in b) for b in _loader(tensors)]
    b = [tuple(t.tolist() for t in b) for b in _loader(_ListDataset(7))]
    # replica 3 of 4, global batch 4 over 7 samples: [3] then the tail [4,5,6] leaves it nothing
    assert [y for _, y in a] == [[3], []] == [y for _, y in b]
    assert a == b


def test_every_batch_carries_its_own_facts_whatever_its_structure():
    weights = []
    loader = _loader(_ListDataset(7), weigh=lambda b: weights.append(b) or len(b.indices) / 2)
    first, second = list(loader)  # replica 3 of 4 over 7 samples: [3] of 4, then nothing of 3
    assert towerflow.batch_facts(first) == towerflow.BatchFacts(1, 4, 0.5, is_last=False)
    assert towerflow.batch_facts(second) == towerflow.BatchFacts(0, 3, 0.0, is_last=True)
    assert towerflow.batch_facts(second).is_empty and len(weights) == 2
    tensors = TensorDataset(torch.arange(7.0), torch.arange(7))
    (x, y), _ = list(_loader(tensors))
    assert towerflow.batch_facts(y).local_size == towerflow.batch_facts((x, y)).local_size == 1
    assert towerflow.batch_facts((torch.ones(2), torch.ones(2))) is None  # a batch built by hand


def test_forever_runs_across_epochs():
    loader = DistributedLoader(TensorDataset(torch.arange(6)), ShardSampler(6, 2, 1, 0, seed=1), torch.device("cpu"))
    epochs = [sorted(int(v) for b in [next(it) for _ in range(3)] for v in b[0]) for it in [loader.forever()]]
    assert epochs[0] == [0, 1, 2, 3, 4, 5]


def test_copies_to_a_device_are_counted_in_the_placement_log():
    towerflow.configure(log_device_placement="summary")
    batch = (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    out = copy_to_device(batch, torch.device("meta"), "/device:META:0")
    assert out[0].device.type == "meta"
    summary = towerflow.placement_log().summary()
    assert summary.host_to_device_bytes == 4 * 8 * 4 + 4 * 8
    assert any(r.op_type == "MemcpyHtoD" for r in towerflow.placement_log())


def test_nothing_is_copied_or_logged_on_the_cpu():
    towerflow.configure(log_device_placement="summary")
    batches = [(torch.ones(2),)] * 3
    assert len(list(DevicePrefetcher(batches, torch.device("cpu")))) == 3
    assert towerflow.placement_log().summary().bytes_moved == 0


@pytest.mark.gpu
def test_prefetch_to_gpu_pins_copies_ahead_and_logs_bytes():
    towerflow.configure(log_device_placement="summary")
    batches = [(torch.full((256, 256), float(i)),) for i in range(4)]
    out = [b[0] for b in DevicePrefetcher(batches, torch.device("cuda", 0))]
    assert all(t.device.type == "cuda" for t in out)
    assert [float(t[0, 0]) for t in out] == [0.0, 1.0, 2.0, 3.0]
    assert towerflow.placement_log().summary().host_to_device_bytes == 4 * 256 * 256 * 4


@pytest.mark.gpu
def test_a_tensor_dataset_is_gathered_straight_into_pinned_memory_for_a_gpu():
    data = TensorDataset(torch.arange(64.0).view(32, 2), torch.arange(32))
    loader = towerflow.OneDeviceStrategy("/gpu:0").distribute_loader(data, batch_size=8, shuffle=False)
    x, y = next(loader._host_batches(list(loader.sampler.batches())))
    assert x.is_pinned() and y.is_pinned() and x[1].tolist() == [2.0, 3.0]
    assert [b[1].tolist() for b in loader][0] == list(range(8))


def test_an_iterable_dataset_is_refused_with_the_fix():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(towerflow.DataError, match="map-style dataset"):
        towerflow.OneDeviceStrategy().distribute_loader(Stream(), batch_size=2)
