"""Layouts: where each variable (or each row shard) lands, and that shards reassemble exactly."""

from __future__ import annotations

import pickle

import pytest
import torch

from towerflow.errors import LayoutError
from towerflow.ps import plan_layout


def _vars(*specs):
    return {name: torch.empty(*shape, device="meta") for name, shape in specs}


@pytest.mark.parametrize(
    "names, num_ps, expected",
    [
        (["a", "b", "c", "d", "e"], 2, [0, 1, 0, 1, 0]),
        (["a", "b", "c"], 3, [0, 1, 2]),
        (["a", "b"], 4, [0, 1]),
        (["a", "b", "c"], 1, [0, 0, 0]),
    ],
)
def test_round_robin_places_the_ith_variable_on_task_i_mod_ps(names, num_ps, expected):
    layout = plan_layout(_vars(*[(n, (3,)) for n in names]), num_ps)
    assert [layout.shards_of(n)[0].task for n in names] == expected


@pytest.mark.parametrize(
    "sizes, num_ps, expected_tasks, expected_bytes",
    [
        # largest first onto the lightest task: 100 -> 0, 60 -> 1, 50 -> 1, 10 -> 0
        ([10, 100, 50, 60], 2, [0, 0, 1, 1], [440, 440]),
        ([8, 8, 8, 8], 2, [0, 1, 0, 1], [64, 64]),
        ([1000, 1, 1, 1], 3, [0, 1, 2, 1], [4000, 8, 4]),
    ],
)
def test_greedy_balances_bytes(sizes, num_ps, expected_tasks, expected_bytes):
    layout = plan_layout(_vars(*[(f"v{i}", (s,)) for i, s in enumerate(sizes)]), num_ps, "greedy")
    assert [layout.shards_of(f"v{i}")[0].task for i in range(len(sizes))] == expected_tasks
    assert layout.bytes_per_task() == expected_bytes


def test_greedy_beats_round_robin_on_a_skewed_model():
    vs = _vars(("emb", (1000, 16)), ("w", (16, 16)), ("out", (16, 1000)), ("b", (16,)))
    rr = plan_layout(vs, 2).bytes_per_task()
    gr = plan_layout(vs, 2, "greedy").bytes_per_task()
    assert max(gr) - min(gr) < max(rr) - min(rr)


@pytest.mark.parametrize(
    "rows, shards, expected",
    [
        (10, 3, [(0, 4), (4, 7), (7, 10)]),
        (9, 3, [(0, 3), (3, 6), (6, 9)]),
        (2, 4, [(0, 1), (1, 2)]),  # never more shards than rows
    ],
)
def test_partitioned_rows(rows, shards, expected):
    layout = plan_layout(_vars(("emb", (rows, 5))), 4, partition={"emb": shards})
    got = layout.shards_of("emb")
    assert [(s.row_start, s.row_stop) for s in got] == expected
    assert [s.task for s in got] == list(range(len(expected)))
    assert sum(s.nbytes for s in got) == rows * 5 * 4


def test_partitioned_rows_reassemble_exactly():
    table = torch.randn(1001, 7)
    layout = plan_layout({"emb": table, "w": torch.randn(7, 3)}, 3, partition=1000)
    parts = layout.split("emb", table)
    assert len(parts) == 3 and [p.shape[0] for p in parts] == [334, 334, 333]
    assert torch.equal(layout.assemble("emb", [p.clone() for p in parts]), table)
    assert len(layout.shards_of("w")) == 1  # 84 bytes: under the threshold


def test_offsets_pack_each_tasks_flat_buffer_per_dtype():
    vs = {"a": torch.empty(3), "h": torch.empty(5, dtype=torch.float16), "b": torch.empty(2, 2), "c": torch.empty(4)}
    layout = plan_layout(vs, 2)
    assert [(s.variable, s.task, s.offset) for s in layout.shards] == [("a", 0, 0), ("h", 1, 0), ("b", 0, 3), ("c", 1, 0)]
    assert layout.flat_sizes(0) == {torch.float32: 7}
    assert layout.flat_sizes(1) == {torch.float16: 5, torch.float32: 4}


def test_layout_prints_variable_shard_task_and_bytes():
    layout = plan_layout(_vars(("emb", (10, 4)), ("b", (4,))), 2, partition={"emb": 2})
    text = str(layout)
    assert "emb  " in text and "0/2" in text and "/job:ps/task:1" in text and "0:5" in text
    assert "/job:ps/task:0: 2 shards, 96 bytes" in text
    assert "/job:ps/task:1: 1 shards, 80 bytes" in text


def test_same_inputs_give_the_same_layout_on_every_task():
    vs = _vars(("a", (5, 3)), ("b", (9,)), ("c", (2, 2)))
    assert plan_layout(vs, 2, "greedy").shards == plan_layout(vs, 2, "greedy").shards


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_ps=0), "num_ps=0"),
        (dict(num_ps=2, placement="round-robin"), "Did you mean 'round_robin'"),
        (dict(num_ps=2, partition={"s": 2}), "scalar"),
        (dict(num_ps=2, partition={"a": 0}), "at least 1"),
    ],
)
def test_bad_requests_say_what_to_do(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        plan_layout({"a": torch.empty(4), "s": torch.empty(())}, **kwargs)


def test_layout_error_survives_pickling():
    e = LayoutError("bad")
    assert str(pickle.loads(pickle.dumps(e))) == "bad"
