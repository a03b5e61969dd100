"""Sharding: every sample once per epoch across replicas, equal step counts, uneven tails split fairly."""

import pytest

from towerflow.data import ShardSampler
from towerflow.errors import DataError


def _epoch(size, global_batch, n, epoch=0, **kw):
    samplers = [ShardSampler(size, global_batch, n, r, **kw) for r in range(n)]
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s.batches()) for s in samplers]


@pytest.mark.parametrize(
    "size,global_batch,n",
    [(100, 10, 2), (101, 10, 2), (27, 8, 4), (7, 4, 4), (5, 4, 4), (1000, 64, 3), (9, 9, 1), (0, 4, 2)],
)
def test_every_sample_exactly_once_and_same_step_count(size, global_batch, n):
    plans = _epoch(size, global_batch, n)
    seen = [i for plan in plans for b in plan for i in b.indices]
    assert sorted(seen) == list(range(size))  # coverage, no duplicates
    assert len({len(plan) for plan in plans}) == 1  # all replicas run the same number of steps
    for step in zip(*plans):
        sizes = [len(b.indices) for b in step]
        assert sum(sizes) == step[0].global_size
        assert max(sizes) - min(sizes) <= 1  # an uneven tail is split as evenly as it can be


def test_replica_slices_are_contiguous_parts_of_the_same_global_batch():
    plans = _epoch(40, 8, 2, seed=7)
    one = _epoch(40, 8, 1, seed=7)[0]
    for a, b, whole in zip(plans[0], plans[1], one):
        assert a.indices + b.indices == whole.indices  # so N replicas see what one replica with N*b sees


def test_epochs_reshuffle_deterministically():
    a0 = _epoch(50, 10, 2, epoch=0)
    a1 = _epoch(50, 10, 2, epoch=1)
    assert a0 == _epoch(50, 10, 2, epoch=0)
    assert a0 != a1
    assert _epoch(50, 10, 2, shuffle=False)[0][0].indices == (0, 1, 2, 3, 4)


def test_drop_last_drops_only_the_short_tail():
    plans = _epoch(25, 10, 2, drop_last=True)
    assert len(plans[0]) == 2
    assert sum(len(b.indices) for p in plans for b in p) == 20


def test_sampler_is_a_batch_sampler():
    s = ShardSampler(10, 4, 2, 1, shuffle=False)
    assert list(s) == [[2, 3], [6, 7], [9]]
    assert len(s) == 3


@pytest.mark.parametrize("kwargs", [dict(global_batch_size=1, num_replicas=2), dict(replica_id=2, num_replicas=2)])
def test_bad_requests_name_the_value(kwargs):
    args = dict(dataset_size=10, global_batch_size=4, num_replicas=1, replica_id=0)
    args.update(kwargs)
    with pytest.raises(DataError, match="expected|needs"):
        ShardSampler(**args)
