"""A batch's list bags stay with their records however the stream shuffles, cuts and joins batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from towerflow.data import Categorical, CategoricalList, Dense, Features, Schema
from towerflow.data.features import FeatureNames
from towerflow.errors import DataError

NAMES = FeatureNames.of(Schema("y", (Dense("d"), Categorical("c", 10), CategoricalList("a", 10),
                                     CategoricalList("b", 10))))


def _random_batch(rng, n):
    bags = []
    for _ in range(2):
        counts = rng.integers(0, 4, n)
        bags.append((torch.from_numpy(rng.integers(0, 1000, int(counts.sum()))), torch.from_numpy(counts)))
    return Features(NAMES, torch.from_numpy(rng.normal(size=(n, 1)).astype(np.float32)),
                    torch.from_numpy(rng.integers(0, 10, (n, 1))), tuple(bags),
                    torch.from_numpy(rng.integers(0, 2, n).astype(np.float32)))


def _records(batch):
    """Each record as (label, dense, ids, bag a, bag b), its bags read through the offsets a model uses."""
    out = []
    bags = []
    for name in ("a", "b"):
        ids, offsets = batch[name]
        ends = torch.cat([offsets[1:], torch.tensor([len(ids)])])
        bags.append([tuple(ids[s:e].tolist()) for s, e in zip(offsets.tolist(), ends.tolist())])
    for i in range(len(batch)):
        out.append((batch.labels[i].item(), batch.dense[i].tolist(), batch.ids[i].tolist(), bags[0][i], bags[1][i]))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_take_slice_and_cat_keep_every_bag_with_its_record(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 30))
    batch = _random_batch(rng, n)
    records = _records(batch)
    order = torch.from_numpy(rng.permutation(n))
    assert _records(batch.take(order)) == [records[i] for i in order.tolist()]
    picks = torch.from_numpy(rng.integers(0, n, int(rng.integers(0, 2 * n))))  # any index, repeats too
    assert _records(batch.take(picks)) == [records[i] for i in picks.tolist()]
    start, stop = sorted(rng.integers(0, n + 1, 2).tolist())
    assert _records(batch.slice(start, stop)) == records[start:stop]
    cut = int(rng.integers(0, n + 1))
    other = _random_batch(rng, int(rng.integers(1, 10)))
    joined = Features.cat([batch.slice(0, cut), other, batch.slice(cut, n)])
    assert _records(joined) == records[:cut] + _records(other) + records[cut:]


def test_a_batch_names_its_features_and_refuses_an_unknown_one():
    batch = _random_batch(np.random.default_rng(0), 3)
    assert batch.features() == ["d", "c", "a", "b"]
    assert [name for name, _ in batch.categorical()] == ["c", "a", "b"]
    with pytest.raises(DataError, match="no feature 'nope' in this batch: it has d, c, a, b"):
        batch["nope"]
    with pytest.raises(DataError, match="list columns"):
        batch.as_tuple()
