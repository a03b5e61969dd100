"""Row stores: FixedRows equals its row optimizer; HashRows admits, evicts and counts exactly; both save and reshard."""

from __future__ import annotations

import pytest
import torch

from towerflow.errors import ParameterServerError
from towerflow.ps import FTRL, SparseAdagrad, SparseAdam, SparseSGD
from towerflow.ps.tables.rows import FixedRows
from towerflow.ps.tables.vocabulary import HashRows

torch.set_num_threads(1)

SPECS = [SparseSGD(0.1), SparseAdagrad(0.1, initial_accumulator_value=0.1, lr_decay=0.01), SparseAdam(0.01),
         FTRL(0.1, l1=0.001, l2=0.01)]


def IDS(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def _equal_dicts(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _equal_dicts(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _sorted_by_id(saved):
    """A HashRows state_dict with its rows in id order (slots, and so row order, may differ between equal tables)."""
    order = torch.argsort(saved["ids"])
    out = dict(saved, ids=saved["ids"][order], values=saved["values"][order], last_touched=saved["last_touched"][order])
    out["state"] = {k: v[order] for k, v in saved["state"].items()}
    return out


# ---- FixedRows
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: type(s).__name__)
def test_fixed_rows_equal_the_row_optimizer_applied_directly(spec):
    values = torch.randn(12, 3)
    store = FixedRows(values.clone(), spec)
    ref, ref_state = values.clone(), spec.init_state(values)
    gen = torch.Generator().manual_seed(0)
    for step, rows in enumerate([[0, 4, 7], [4, 5], [11, 0, 3, 7], [2], [7, 4]], start=1):
        ids, grads = IDS(*rows), torch.randn(len(rows), 3, generator=gen)
        torch.testing.assert_close(store.read(ids), ref[ids], rtol=0, atol=0)
        store.apply(ids, grads, lr=0.05 if step == 3 else None, lr_scale=0.5 if step == 4 else 1.0)
        spec.apply(ref, ref_state, ids, grads, step, lr=0.05 if step == 3 else None, lr_scale=0.5 if step == 4 else 1.0)
        assert store.updates == step
        assert torch.equal(store.values, ref)
        for name in spec.state_names:
            assert torch.equal(store.state[name], ref_state[name])
    assert torch.equal(store.values[[1, 6, 8, 9, 10]], values[[1, 6, 8, 9, 10]])  # never touched


def test_fixed_rows_take_int32_ids_and_read_a_copy():
    store = FixedRows(torch.arange(12.0).reshape(6, 2), SparseSGD(1.0))
    got = store.read(torch.tensor([5, 0], dtype=torch.int32))
    assert got.tolist() == [[10.0, 11.0], [0.0, 1.0]]
    got += 100
    assert store.values[5].tolist() == [10.0, 11.0]
    store.apply(torch.tensor([5], dtype=torch.int32), torch.ones(1, 2))
    assert store.values[5].tolist() == [9.0, 10.0]


def test_fixed_rows_size_and_bytes():
    store = FixedRows(torch.zeros(100, 8), SparseAdam())
    assert store.rows_held == 100 and store.dim == 8
    assert store.nbytes == 3 * 100 * 8 * 4  # values, exp_avg, exp_avg_sq


@pytest.mark.parametrize("call, text", [
    (lambda s: s.read(IDS(0, 6)), "row id 6 is outside this shard's 6 rows [0, 6)"),
    (lambda s: s.read(IDS(-1)), "row id -1 is outside"),
    (lambda s: s.read(torch.tensor([0.0])), "ids must be a 1-D int32 or int64 tensor, got a torch.float32"),
    (lambda s: s.apply(IDS(0, 1), torch.ones(3, 2)), "grads has shape (3, 2), expected (2, 2)"),
])
def test_fixed_rows_refuse_bad_ids_and_grads(call, text):
    with pytest.raises(ParameterServerError) as err:
        call(FixedRows(torch.zeros(6, 2), SparseSGD(0.1)))
    assert text in str(err.value)


def test_fixed_rows_state_dict_round_trip_and_shape_check():
    store = FixedRows(torch.randn(8, 3), SparseAdagrad(0.1))
    store.apply(IDS(1, 5), torch.randn(2, 3))
    store.apply(IDS(5), torch.randn(1, 3))
    saved = store.state_dict()
    other = FixedRows(torch.zeros(8, 3), SparseAdagrad(0.1))
    other.load_state_dict(saved)
    _equal_dicts(other.state_dict(), saved)
    assert other.updates == 2
    store.apply(IDS(5), torch.ones(1, 3))  # the saved copy does not follow the store
    assert not torch.equal(store.state_dict()["values"], saved["values"])
    with pytest.raises(ParameterServerError, match=r"values has shape \(8, 3\), expected \(9, 3\)"):
        FixedRows(torch.zeros(9, 3), SparseAdagrad(0.1)).load_state_dict(saved)
    with pytest.raises(ParameterServerError, match=r"holds \['sum'\] but SparseAdam keeps \['exp_avg', 'exp_avg_sq'\]"):
        FixedRows(torch.zeros(8, 3), SparseAdam()).load_state_dict(saved)


def test_fixed_rows_reshard_two_shards_onto_three():
    spec = SparseAdam(0.01)
    whole = torch.randn(10, 2)
    old = [FixedRows(whole[:5].clone(), spec), FixedRows(whole[5:].clone(), spec)]
    old[0].apply(IDS(0, 3), torch.randn(2, 2))
    old[1].apply(IDS(4), torch.randn(1, 2))
    old[1].apply(IDS(1, 4), torch.randn(2, 2))
    starts_old, bounds_new = [0, 5], [(0, 4), (4, 7), (7, 10)]
    new = [FixedRows(torch.zeros(b - a, 2), spec) for a, b in bounds_new]
    for store, start in zip(old, starts_old):
        ids, values, state = store.export()
        ids = ids + start  # global
        for (a, b), target in zip(bounds_new, new):
            m = (ids >= a) & (ids < b)
            target.load_rows(ids[m] - a, values[m], {k: v[m] for k, v in state.items()}, updates=store.updates)
    assert torch.equal(torch.cat([s.values for s in new]), torch.cat([s.values for s in old]))
    for name in spec.state_names:
        assert torch.equal(torch.cat([s.state[name] for s in new]), torch.cat([s.state[name] for s in old]))
    assert [s.updates for s in new] == [2, 2, 2]  # the largest count of the old shards each drew from


def test_empty_calls_change_only_the_update_count():
    fixed, table = FixedRows(torch.ones(4, 2), SparseAdam()), HashRows(2, SparseAdam())
    assert fixed.read(IDS()).shape == (0, 2) and table.read(IDS(), 0).shape == (0, 2)
    fixed.apply(IDS(), torch.zeros(0, 2))
    table.apply(IDS(), torch.zeros(0, 2), 0)
    assert fixed.updates == table.updates == 1  # every apply is one update, as every torch step() is
    assert torch.equal(fixed.values, torch.ones(4, 2)) and table.rows_held == 0


def test_load_state_dict_says_what_it_expected():
    with pytest.raises(ParameterServerError, match=r"expected a FixedRows.state_dict\(\), which has \['values'"):
        FixedRows(torch.zeros(2, 2), SparseSGD(0.1)).load_state_dict({"weights": torch.zeros(2, 2)})
    with pytest.raises(ParameterServerError, match=r"expected a HashRows.state_dict\(\), which has \['ids'"):
        HashRows(2, SparseSGD(0.1)).load_state_dict({"dim": 2})


# ---- HashRows: admission
def test_rows_appear_on_the_third_sighting_with_admit_after_3():
    table = HashRows(4, SparseAdagrad(0.1), admit_after=3)
    for step in (1, 2):
        assert torch.equal(table.read(IDS(7, -3), step), torch.zeros(2, 4))
        assert 7 not in table and -3 not in table
        assert table.metrics() == {"rows": 0, "admitted": 0, "evicted": 0, "pending": 2}
    assert table.nbytes == HashRows(4, SparseAdagrad(0.1)).nbytes  # nothing grew for pending ids
    got = table.read(IDS(7, 11), 3)  # 7's third sighting; 11's first
    assert 7 in table and 11 not in table
    assert (got[0] != 0).all() and torch.equal(got[1], torch.zeros(4))
    assert table.metrics() == {"rows": 1, "admitted": 1, "evicted": 0, "pending": 2}
    assert torch.equal(table.read(IDS(7), 4), got[:1])  # the row stays
    table.read(IDS(-3), 5)
    assert table.metrics() == {"rows": 2, "admitted": 2, "evicted": 0, "pending": 1}


def test_new_rows_are_drawn_from_the_seeded_generator_with_fresh_state():
    a = HashRows(16, FTRL(0.1), init_std=0.5, seed=3)
    b = HashRows(16, FTRL(0.1), init_std=0.5, seed=3)
    ra, rb = a.read(IDS(10, 20, 30), 0), b.read(IDS(10, 20, 30), 0)
    assert torch.equal(ra, rb)
    assert torch.equal(ra, torch.randn(3, 16, generator=torch.Generator().manual_seed(3)) * 0.5)
    assert not torch.equal(ra, HashRows(16, FTRL(0.1), init_std=0.5, seed=4).read(IDS(10, 20, 30), 0))
    _, _, state = a.export()
    assert torch.equal(state["accum"], torch.full((3, 16), 0.1)) and torch.equal(state["linear"], torch.zeros(3, 16))


def test_hash_rows_apply_equals_the_row_optimizer_and_counts_updates():
    spec = SparseAdam(0.01)
    table = HashRows(3, spec, seed=1)
    ids = IDS(100, -5, 2**40)
    ref = table.read(ids, 0).clone()
    ref_state = spec.init_state(ref)
    for step in range(1, 5):
        grads = torch.randn(3, 3)
        table.apply(ids, grads, step)
        spec.apply(ref, ref_state, torch.arange(3), grads, step)
        assert table.updates == step
    assert torch.equal(table.read(ids, 5), ref)


def test_applying_to_ids_without_a_row_changes_nothing():
    table = HashRows(2, SparseSGD(1.0), admit_after=2, evict_after=3)
    table.read(IDS(1, 2), 0)
    table.read(IDS(1), 1)  # 1 admitted, 2 pending
    before = table.state_dict()
    table.apply(IDS(2, 99), torch.ones(2, 2), 2)  # pending and never-seen ids
    after = table.state_dict()
    for key in ("ids", "values", "last_touched", "pending_ids", "pending_counts"):
        assert torch.equal(before[key], after[key])
    assert table.metrics() == {"rows": 1, "admitted": 1, "evicted": 0, "pending": 1}
    assert torch.equal(table.read(IDS(99), 2), torch.zeros(1, 2))  # and 99 only has its one sighting now
    assert table.metrics()["pending"] == 2
    table.evict(4)  # 1, last touched at 1, goes
    assert 1 not in table
    table.apply(IDS(1), torch.ones(1, 2), 5)
    assert 1 not in table and table.metrics() == {"rows": 0, "admitted": 1, "evicted": 1, "pending": 2}


def test_with_forget_after_an_id_unseen_that_long_counts_its_sightings_from_one_again():
    table = HashRows(2, SparseSGD(0.1), admit_after=2, forget_after=3)
    table.read(IDS(5, 6), 0)
    table.read(IDS(6), 3)  # 6's second sighting, 3 steps after its first: too late, it counts as a first
    assert 6 not in table and table.metrics()["pending"] == 2
    table.read(IDS(5), 2)  # 5's second, 2 steps after its first: admitted
    table.read(IDS(6), 5)  # 6's second within 3 steps of the last: admitted
    assert 5 in table and 6 in table and table.metrics() == {"rows": 2, "admitted": 2, "evicted": 0, "pending": 0}


def test_with_forget_after_the_pending_ids_stay_bounded():
    table = HashRows(2, SparseSGD(0.1), admit_after=2, forget_after=5)
    most = 0
    for step in range(200):  # 100 ids a step that are never seen again: none is ever admitted
        table.read(torch.arange(100 * step, 100 * (step + 1)), step)
        table.evict(step)
        most = max(most, table.metrics()["pending"])
    assert table.rows_held == 0 and most <= 100 * 2 * 5  # the ids of the last 2 x forget_after steps, not all 20,000
    never = HashRows(2, SparseSGD(0.1), admit_after=2, evict_after=5)  # without forget_after every sighting is kept
    for step in range(20):
        never.read(torch.arange(100 * step, 100 * (step + 1)), step)
        never.evict(step)
    assert never.metrics()["pending"] == 2000


def test_pending_sightings_keep_their_steps_through_a_checkpoint_and_older_checkpoints_load():
    table = HashRows(2, SparseSGD(0.1), admit_after=2, forget_after=3)
    table.read(IDS(5), 0)
    table.read(IDS(6), 2)
    saved = table.state_dict()
    restored = HashRows(2, SparseSGD(0.1), admit_after=2, forget_after=3)
    restored.load_state_dict(saved)
    restored.read(IDS(5, 6), 4)  # 5 last seen at 0: expired, counts from one; 6 at 2: its second, admitted
    assert 5 not in restored and 6 in restored
    older = {k: v for k, v in saved.items() if k != "pending_steps"}  # written before sightings had steps
    from_older = HashRows(2, SparseSGD(0.1), admit_after=2, forget_after=3)
    from_older.load_state_dict(older)  # their sightings count as seen at the checkpoint's clock (2)
    from_older.read(IDS(5, 6), 4)
    assert 5 in from_older and 6 in from_older


# ---- HashRows: eviction
def test_rows_are_evicted_exactly_when_untouched_for_evict_after_steps():
    table = HashRows(2, SparseSGD(0.1), evict_after=5)
    table.read(IDS(1, 2, 3), 0)
    table.apply(IDS(2), torch.ones(1, 2), 2)  # an update touches
    table.read(IDS(3), 3)  # so does a read
    assert table.evict(4) == 0
    assert table.evict(5) == 1 and 1 not in table  # untouched since 0: 5 steps
    assert table.evict(6) == 0
    assert table.evict(7) == 1 and 2 not in table
    assert table.evict(8) == 1 and 3 not in table
    assert table.metrics() == {"rows": 0, "admitted": 3, "evicted": 3, "pending": 0}
    assert table.evict(100) == 0


def test_without_evict_after_nothing_is_evicted():
    table = HashRows(2, SparseSGD(0.1))
    table.read(IDS(1), 0)
    assert table.evict(10**9) == 0 and 1 in table


def test_slot_reuse_keeps_other_rows_intact_and_an_evicted_id_starts_over():
    table = HashRows(3, SparseAdagrad(0.1), admit_after=2, evict_after=2, seed=5)
    ids = torch.arange(100)
    table.read(ids, 0)
    table.read(ids, 0)
    assert table.metrics() == {"rows": 100, "admitted": 100, "evicted": 0, "pending": 0}
    keep = ids[ids % 3 == 0]
    table.apply(keep, torch.randn(keep.numel(), 3), 1)
    kept = table.read(keep, 1).clone()
    _, _, kept_state = table.export()
    assert table.evict(2) == 100 - keep.numel()
    newcomers = torch.arange(1000, 1100)
    table.read(newcomers, 2)
    table.read(newcomers, 2)  # admitted into the freed slots (and beyond)
    assert torch.equal(table.read(keep, 3), kept)
    assert table.metrics() == {"rows": 134, "admitted": 200, "evicted": 66, "pending": 0}
    # an evicted id counts its sightings from 0 again
    assert torch.equal(table.read(IDS(1), 3), torch.zeros(1, 3)) and 1 not in table
    table.read(IDS(1), 4)
    assert 1 in table and table.metrics()["admitted"] == 201
    ids_now, _, state_now = table.export()
    sums = dict(zip(ids_now.tolist(), state_now["sum"]))
    assert torch.equal(sums[1], torch.zeros(3))  # fresh optimizer state, not the evicted row's


def test_hash_rows_grow_past_their_first_capacity():
    table = HashRows(2, SparseSGD(0.1))
    first = table.read(torch.arange(10), 0).clone()
    table.read(torch.arange(10, 5000), 0)
    assert table.rows_held == 5000
    assert torch.equal(table.read(torch.arange(10), 1), first)


def test_int32_ids_work():
    table = HashRows(2, SparseSGD(1.0))
    got = table.read(torch.tensor([4, -4], dtype=torch.int32), 0)
    table.apply(torch.tensor([4], dtype=torch.int32), torch.ones(1, 2), 1)
    assert torch.equal(table.read(IDS(4, -4), 2), got - torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


@pytest.mark.parametrize("kw, text", [
    ({"admit_after": 0}, "HashRows(admit_after=0): expected an int >= 1"),
    ({"admit_after": 2.0}, "HashRows(admit_after=2.0): expected an int >= 1"),
    ({"admit_after": True}, "HashRows(admit_after=True)"),
    ({"evict_after": 0}, "HashRows(evict_after=0): expected None (rows are never evicted) or an int >= 1"),
    ({"evict_after": -5}, "HashRows(evict_after=-5)"),
    ({"forget_after": 0}, "HashRows(forget_after=0): expected None (sightings of ids not admitted are kept until"),
    ({"dtype": torch.int64}, "HashRows(dtype=torch.int64): expected a floating torch.dtype"),
    ({"init_std": -1.0}, "HashRows(init_std=-1.0)"),
])
def test_hash_rows_refuse_bad_settings(kw, text):
    with pytest.raises(ParameterServerError) as err:
        HashRows(4, SparseSGD(0.1), **kw)
    assert text in str(err.value)


def test_hash_rows_refuse_a_repeated_new_id():
    table = HashRows(2, SparseSGD(0.1), admit_after=2)
    with pytest.raises(ParameterServerError, match="read: an id without a row appears twice in one call .* coalesce"):
        table.read(IDS(5, 6, 5), 0)
    assert table.metrics() == {"rows": 0, "admitted": 0, "evicted": 0, "pending": 0}  # nothing counted
    with pytest.raises(ParameterServerError, match="load_rows: an id without a row appears twice"):
        table.load_rows(IDS(1, 1), torch.zeros(2, 2), {})


def test_hash_rows_refuse_a_torch_optimizer():
    with pytest.raises(ParameterServerError, match="expected a RowOptimizer .* row_optimizer_for"):
        HashRows(4, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


# ---- HashRows: checkpoints and resharding
def _busy_table(**kw):
    table = HashRows(3, SparseAdam(0.01), admit_after=2, evict_after=3, seed=9, **kw)
    for step in range(6):
        ids = torch.arange(step, step + 20) * 7 - 30
        table.read(ids, step)
        table.apply(ids, torch.randn(20, 3), step)
        table.evict(step)
    return table


def test_hash_rows_state_dict_round_trip():
    table = _busy_table()
    m = table.metrics()
    assert m["evicted"] > 0 and m["pending"] > 0 and m["rows"] > 0
    saved = table.state_dict()
    other = HashRows(3, SparseAdam(0.01), admit_after=2, evict_after=3, seed=0)
    other.load_state_dict(saved)
    _equal_dicts(other.state_dict(), saved)
    assert other.metrics() == m
    # and both go on identically: same admissions (same generator), evictions and updates
    for t in (table, other):
        ids = torch.arange(0, 40) * 7 - 30
        t.read(ids, 6)
        t.apply(ids, torch.ones(40, 3), 6)
        t.evict(8)
    _equal_dicts(_sorted_by_id(other.state_dict()), _sorted_by_id(table.state_dict()))


def test_hash_rows_load_checks_dim_and_optimizer():
    saved = _busy_table().state_dict()
    with pytest.raises(ParameterServerError, match="3 wide, this table's dim=4"):
        HashRows(4, SparseAdam(0.01)).load_state_dict(saved)
    with pytest.raises(ParameterServerError, match=r"holds \['exp_avg', 'exp_avg_sq'\] but FTRL keeps"):
        HashRows(3, FTRL(0.1)).load_state_dict(saved)


def test_hash_rows_export_and_load_rows_reshard_one_shard_onto_two():
    table = _busy_table()
    ids, values, state = table.export()
    assert set(state) == {"exp_avg", "exp_avg_sq", "last_touched"}
    new = [HashRows(3, SparseAdam(0.01), evict_after=3) for _ in range(2)]
    for i, target in enumerate(new):
        m = ids % 2 == i
        target.load_rows(ids[m], values[m], {k: v[m] for k, v in state.items()}, updates=table.updates)
    assert sum(t.rows_held for t in new) == table.rows_held
    for i, target in enumerate(new):
        m = ids % 2 == i
        assert torch.equal(target.read(ids[m], 5), values[m]) and target.updates == table.updates
        got_ids, got_values, got_state = target.export()
        order = torch.argsort(got_ids)
        want_order = torch.argsort(ids[m])
        assert torch.equal(got_ids[order], ids[m][want_order])
        assert torch.equal(got_state["exp_avg"][order], state["exp_avg"][m][want_order])
    # last touched came along: the shards evict what the old one would have
    assert sum(t.evict(9) for t in new) == _busy_table().evict(9)
