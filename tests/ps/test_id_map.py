"""The tensor id -> slot table behaves like a dict, whatever the ids and however often they come and go."""

from __future__ import annotations

import random

import torch

from towerflow.ps.tables._id_map import IdMap

torch.set_num_threads(1)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _t(xs):
    return torch.tensor(list(xs), dtype=torch.int64)


def test_lookup_insert_remove_match_a_dict_through_many_rounds():
    rng = random.Random(0)
    m, d = IdMap(), {}
    for round_ in range(200):
        r = rng.random()
        if r < 0.5:  # insert a batch of absent ids: huge, negative and small ones that crowd a few positions
            pool = {rng.randrange(INT64_MIN, INT64_MAX) if rng.random() < 0.5 else rng.randrange(-300, 300)
                    for _ in range(rng.randrange(0, 300))}
            new = sorted(pool - set(d))
            slots = [rng.randrange(0, 10**9) for _ in new]
            m.insert(_t(new), _t(slots))
            d.update(zip(new, slots))
        elif r < 0.8:  # remove some present and some absent ids
            gone = set(rng.sample(sorted(d), min(len(d), rng.randrange(0, 150)))) | {rng.randrange(-300, 300)}
            m.remove(_t(gone))
            for k in gone:
                d.pop(k, None)
        queries = sorted(d)[:400] + [rng.randrange(-400, 400) for _ in range(100)]
        assert m.lookup(_t(queries)).tolist() == [d.get(k, -1) for k in queries], round_
        assert len(m) == len(d)


def test_extreme_and_colliding_ids():
    m = IdMap()
    ids = [INT64_MIN, INT64_MAX, 0, -1, 1, 2**40, -(2**40)] + [i << 58 for i in range(-32, 31)]  # same low bits
    ids += [0x7FF0000000000001, 0xFFF0000000000001 - 2**64]  # NaN bit patterns, were they read as floats
    ids = sorted(set(ids))
    m.insert(_t(ids), torch.arange(len(ids)))
    assert m.lookup(_t(ids)).tolist() == list(range(len(ids)))
    assert m.lookup(_t([2, -2, 3 << 57])).tolist() == [-1, -1, -1]


def test_a_removed_id_comes_back_with_its_new_slot_and_churn_keeps_half_the_table_empty():
    m = IdMap()
    m.insert(torch.arange(10_000), torch.arange(10_000) + 5)
    m.remove(torch.arange(0, 10_000, 2))
    m.insert(torch.arange(0, 10_000, 4), torch.full((2500,), 7))
    got = m.lookup(torch.arange(10_000))
    want = torch.where(torch.arange(10_000) % 2 == 1, torch.arange(10_000) + 5, -1)
    want[::4] = 7
    assert torch.equal(got, want) and len(m) == 7500
    m.remove(torch.arange(10_000))
    m.insert(_t([42]), _t([0]))
    for i in range(20):
        batch = torch.arange(500) + 10**6 + 500 * i
        m.insert(batch, batch)
        m.remove(batch)
    assert len(m) == 1 and m.lookup(_t([42])).tolist() == [0]
    assert 2 * (m._live + m._gone) <= m._slots.numel()  # removed pairs are reused or rebuilt away: probes stay short


def test_empty_batches():
    m = IdMap()
    m.insert(_t([]), _t([]))
    m.remove(_t([]))
    assert m.lookup(_t([])).tolist() == [] and len(m) == 0
