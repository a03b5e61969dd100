"""A worker's row routing: each looked-up id goes to the one ps task that holds its row, and a push sends
each ps task the gradients of exactly the rows it served, in the same order."""

from __future__ import annotations

import pytest
import torch

from towerflow.ps.tables import TableSpec
from towerflow.ps.worker import rows


@pytest.fixture(params=["mod", "div"])
def tables(request):
    return {"a": TableSpec("a", 10, 2, torch.float32, 3, request.param), "b": TableSpec("b", 7, 2, torch.float32, 3,
                                                                                     request.param)}


def _ids():
    return {"a": torch.tensor([0, 2, 3, 5, 9]), "b": torch.tensor([1, 4, 6])}


def test_every_id_goes_to_the_one_task_that_holds_its_row(tables):
    ids = _ids()
    routed = rows.route(tables, ids)
    for name, these in ids.items():
        spec = tables[name]
        seen = torch.zeros(these.numel(), dtype=torch.int64)
        for task, parts in routed.items():
            for table, mask, keys in parts:
                if table != name:
                    continue
                seen += mask.long()
                assert torch.equal(spec.global_ids(task, keys.long()), these[mask])  # the keys are that task's rows
        assert seen.tolist() == [1] * these.numel()  # each id once, nowhere else


def test_a_push_sends_each_task_the_gradients_of_the_rows_it_served(tables):
    ids = _ids()
    last_read = (ids, rows.route(tables, ids))
    grads = {name: (these, torch.arange(these.numel() * 2, dtype=torch.float32).view(-1, 2) + 100 * i)
             for i, (name, these) in enumerate(ids.items())}
    pushes = rows.pushes_by_task(tables, last_read, grads)
    got = {}
    for task, push in pushes.items():
        for table, keys, g in zip(push.tables, push.keys, push.grads):
            for key, row in zip(keys.long(), g):
                got[(table, int(tables[table].global_ids(task, key.view(1))))] = row
    for name, (these, g) in grads.items():
        for i, row_id in enumerate(these.tolist()):
            assert torch.equal(got.pop((name, row_id)), g[i])
    assert not got  # nothing else was sent


def test_gradients_of_ids_the_last_read_did_not_have_are_routed_afresh(tables):
    read = _ids()
    other = {"a": torch.tensor([1, 4, 8])}  # a table called on its own after the model's read
    grads = {"a": (other["a"], torch.ones(3, 2))}
    pushes = rows.pushes_by_task(tables, (read, rows.route(tables, read)), grads)
    sent = sorted(int(tables["a"].global_ids(task, k.view(1))) for task, p in pushes.items() for k in p.keys[0].long())
    assert sent == [1, 4, 8]


def test_a_table_the_loss_did_not_reach_sends_nothing(tables):
    ids = _ids()
    pushes = rows.pushes_by_task(tables, (ids, rows.route(tables, ids)), {"b": (ids["b"], torch.ones(3, 2))})
    assert all(p.tables == ("b",) or p.tables == () for p in pushes.values())
    assert rows.pushes_by_task(tables, (ids, rows.route(tables, ids)), {}) == {}


def test_shards_assemble_into_the_whole_table(tables):
    whole = {name: torch.randn(spec.rows, 2) for name, spec in tables.items()}
    parts = {}
    for name, spec in tables.items():
        shard, local = spec.route(torch.arange(spec.rows))
        for task in range(spec.num_shards):
            rows_here = torch.empty(spec.shard_rows(task), 2)
            rows_here[local[shard == task]] = whole[name][shard == task]
            parts.setdefault(task, {})[name] = rows_here
    out = rows.assemble(tables, parts)
    assert all(torch.equal(out[name], whole[name]) for name in tables)
