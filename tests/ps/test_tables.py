"""Table routing (TF's partition_strategy) and the worker's two-pass lookups, without processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from towerflow.errors import LayoutError, ParameterServerError
from towerflow.ps.tables import TableSpec
from towerflow.ps.worker.lookups import TableLookups, detach_rows, find_tables


@pytest.mark.parametrize("strategy", ["mod", "div"])
@pytest.mark.parametrize("rows,shards", [(10, 3), (7, 7), (5, 8), (1000, 2)])
def test_every_id_has_one_home_and_comes_back(strategy, rows, shards):
    spec = TableSpec("t", rows, 4, torch.float32, shards, strategy)
    ids = torch.arange(rows)
    shard, local = spec.route(ids)
    assert [int((shard == s).sum()) for s in range(shards)] == [spec.shard_rows(s) for s in range(shards)]
    for s in range(shards):  # local rows of a shard are 0..n-1, and global_ids inverts route
        assert sorted(local[shard == s].tolist()) == list(range(spec.shard_rows(s)))
        assert torch.equal(spec.global_ids(s, local[shard == s]), ids[shard == s])


def test_mod_and_div_place_rows_as_tensorflow_does():
    # tf.nn.embedding_lookup docs: 13 ids over 5 partitions
    mod = TableSpec("t", 13, 1, torch.float32, 5, "mod")
    div = TableSpec("t", 13, 1, torch.float32, 5, "div")
    assert mod.route(torch.arange(13))[0].tolist() == [0, 1, 2, 3, 4] * 2 + [0, 1, 2]
    assert div.route(torch.arange(13))[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4]


def test_hash_tables_route_any_int64_id():
    spec = TableSpec("h", None, 4, torch.float32, 3, "hash")
    shard, key = spec.route(torch.tensor([-7, 0, 2**62, 5]))
    assert shard.tolist() == [2, 0, (2**62) % 3, 2] and key.tolist() == [-7, 0, 2**62, 5]


def test_bad_ids_and_settings_are_refused_with_the_table_named():
    spec = TableSpec("user_id", 100, 4, torch.float32, 2)
    with pytest.raises(LayoutError, match=r"'user_id' has 100 rows; id 100 is out of range"):
        spec.check_ids(torch.tensor([3, 100]))
    with pytest.raises(LayoutError, match="float32 ids"):
        spec.check_ids(torch.tensor([1.0]))
    with pytest.raises(LayoutError, match="partition_strategy='modd'.*Did you mean 'mod'"):
        TableSpec("t", 10, 4, torch.float32, 2, "modd")


class Tiny(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.user = nn.Embedding(50, 3, sparse=True, device=device)
        self.items = nn.EmbeddingBag(40, 3, mode="mean", sparse=True, device=device)
        self.head = nn.Linear(6, 1)

    def forward(self, users, items, offsets):
        return self.head(torch.cat([self.user(users), self.items(items, offsets)], 1)).squeeze(1)


def _data():
    users = torch.tensor([1, 7, 7, 49])
    items = torch.tensor([0, 3, 3, 39, 5, 3])
    offsets = torch.tensor([0, 2, 3, 5])
    return users, items, offsets


def test_the_two_pass_lookup_gives_plain_pytorchs_output_and_coalesced_gradients():
    torch.manual_seed(0)
    plain = Tiny()
    patched = Tiny()
    patched.load_state_dict(plain.state_dict())
    full = {"user": plain.user.weight.detach(), "items": plain.items.weight.detach()}
    tables = find_tables(patched, None)
    assert sorted(tables) == ["items", "user"]
    for m in tables.values():
        detach_rows(m)
    reads = []

    def read(ids_by_table):
        reads.append({k: v.tolist() for k, v in ids_by_table.items()})
        return {k: full[k][v].clone() for k, v in ids_by_table.items()}

    lookups = TableLookups(patched, tables, read)
    out_plain, out_patched = plain(*_data()), patched(*_data())
    assert torch.allclose(out_plain, out_patched)
    assert reads == [{"user": [1, 7, 49], "items": [0, 3, 5, 39]}]  # unique ids, one read per forward
    out_plain.sum().backward()
    out_patched.sum().backward()
    grads = lookups.take_row_grads()
    for name, table in (("user", plain.user), ("items", plain.items)):
        ids, rows = grads[name]
        dense = table.weight.grad.to_dense()
        assert torch.allclose(rows, dense[ids]) and dense.abs().sum() == pytest.approx(float(rows.abs().sum()), rel=1e-5)
    assert lookups.take_row_grads() == {}  # handed over once
    assert torch.allclose(patched.head.weight.grad, plain.head.weight.grad)


class Shared(nn.Module):
    """One table looked up twice in a forward: an item id and a bag of recently seen items (shared columns)."""

    def __init__(self):
        super().__init__()
        self.items = nn.EmbeddingBag(40, 3, mode="sum", sparse=True)
        self.head = nn.Linear(6, 1)

    def forward(self, users, items, offsets):
        item = self.items(users.view(-1, 1) % 40)
        return self.head(torch.cat([item, self.items(items, offsets)], 1)).squeeze(1)


def test_a_table_looked_up_by_two_features_gives_plain_pytorchs_output_and_gradients_every_forward():
    torch.manual_seed(0)
    plain, patched = Shared(), Shared()
    patched.load_state_dict(plain.state_dict())
    full = plain.items.weight.detach()
    tables = find_tables(patched, None)
    detach_rows(tables["items"])
    lookups = TableLookups(patched, tables, lambda ids: {k: full[v].clone() for k, v in ids.items()})
    for _ in range(2):  # the first forward counts the table's calls; the second stops its recording after both
        plain.zero_grad()
        out_plain, out_patched = plain(*_data()), patched(*_data())
        assert torch.allclose(out_plain, out_patched)
        out_plain.sum().backward()
        out_patched.sum().backward()
        ids, rows = lookups.take_row_grads()["items"]
        assert torch.allclose(rows, plain.items.weight.grad.to_dense()[ids])


def test_eval_forwards_keep_no_gradients_and_meta_tables_hold_no_rows():
    model = Tiny(device="meta")
    model.head = nn.Linear(6, 1)
    tables = find_tables(model, None)
    assert all(detach_rows(m) is None for m in tables.values())
    assert [n for n, _ in model.named_parameters()] == ["head.weight", "head.bias"]
    lookups = TableLookups(model, tables, lambda ids: {k: torch.ones(v.numel(), 3) for k, v in ids.items()})
    with torch.no_grad():
        assert model(*_data()).shape == (4,)
    assert lookups.take_row_grads() == {}


def test_a_forward_with_ids_from_randomness_is_refused():
    class Random(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.Embedding(1000, 2, sparse=True)

        def forward(self, n):
            return self.t(torch.randint(0, 1000, (n,)))

    model = Random()
    TableLookups(model, find_tables(model, None), lambda ids: {k: torch.zeros(v.numel(), 2) for k, v in ids.items()})
    with pytest.raises(ParameterServerError, match="'t' was called with other ids than in the recording pass"):
        model(64)


def test_options_the_ps_cannot_honour_are_refused():
    model = nn.Sequential(nn.Embedding(10, 2, sparse=True, padding_idx=0))
    with pytest.raises(ParameterServerError, match="padding_idx=0"):
        TableLookups(model, find_tables(model, None), lambda ids: {})


def test_a_hash_embedding_s_forget_after_reaches_the_row_store_on_the_ps():
    from towerflow.ps import HashEmbedding, SparseSGD
    from towerflow.ps.tables.table_shards import make_store
    from towerflow.ps.worker.lookups import table_spec

    spec = table_spec("ids", HashEmbedding(4, admit_after=3, evict_after=50, forget_after=20), 2, "mod", None, 0)
    assert (spec.admit_after, spec.evict_after, spec.forget_after) == (3, 50, 20)
    store = make_store(spec, 1, SparseSGD(0.1))
    assert (store.admit_after, store.evict_after, store.forget_after) == (3, 50, 20)
    assert table_spec("ids", HashEmbedding(4), 2, "mod", None, 0).forget_after is None


@pytest.mark.parametrize("kw, text", [
    ({"admit_after": 0}, "admit_after=0: expected an int >= 1"),
    ({"evict_after": 0}, "evict_after=0: expected None (never) or an int >= 1"),
    ({"forget_after": 0}, "forget_after=0: expected None (sightings kept until the id is admitted) or an int >= 1"),
    ({"forget_after": 2.5}, "forget_after=2.5"),
])
def test_a_hash_embedding_refuses_bad_settings_naming_them(kw, text):
    from towerflow.ps import HashEmbedding

    with pytest.raises(ParameterServerError) as err:
        HashEmbedding(4, **kw)
    assert text in str(err.value)
