"""Recorded scheduler environments (golden.json) and what each must resolve to, or the error it must raise.

Each case: "env" (what the scheduler set), "source" (where that environment comes from: a recording, or
the scheduler's source that writes it), "machine" (the CPUs and CUDA GPUs that torchrun's `auto` counts
there), and "expect" (keys of `towerflow cluster --json`) or "error" (part of the message).
"""

from __future__ import annotations

import json
import pathlib

import pytest

from towerflow import taskenv
from towerflow.cluster.schedulers import resolve
from towerflow.cluster.spec import split_address
from towerflow.errors import SchedulerError

CASES = json.loads((pathlib.Path(__file__).parent / "golden.json").read_text())


def test_there_are_enough_recorded_environments_each_with_where_it_came_from():
    assert len(CASES) >= 100 and len({c["name"] for c in CASES}) == len(CASES)
    assert [c["name"] for c in CASES if len(c.get("source", "")) < 20] == []


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_a_recorded_environment_resolves_as_recorded(case):
    env = taskenv.scheduler_variables(case["env"])  # what TaskContext captures is all a resolver gets
    if "error" in case:
        with pytest.raises(SchedulerError) as caught:
            resolve(env, scheduler=case.get("scheduler"))
        assert case["error"] in str(caught.value)
        return
    resolved = resolve(env, scheduler=case.get("scheduler"))
    if case["expect"] is None:
        assert resolved is None
        return
    got = resolved.as_json()
    assert {k: got[k] for k in case["expect"]} == case["expect"]
    assert set(got["from"]) <= set(env)
    if got["cluster"] is not None and got["address"] is not None:
        assert resolved.cluster_spec().task_address(resolved.job_name, resolved.task_index) == got["address"]
        assert got["port"] == split_address(got["address"])[1]  # a task binds the address the others were told


def _virtual(rank):
    return taskenv.scheduler_variables(next(c["env"] for c in CASES if c["name"].startswith(
        f"torchrun --virtual-local-rank one node: rank {rank}")))


def test_two_ranks_of_one_node_with_local_rank_0_bind_their_own_entries():
    """torchrun --virtual-local-rank: both ranks say LOCAL_RANK=0; the port comes from each rank's cluster entry."""
    ranks = [resolve(_virtual(r)) for r in (0, 1)]
    assert [r.local_rank for r in ranks] == [0, 0]
    assert ranks[0].port != ranks[1].port
    for r in ranks:
        assert r.port == split_address(r.cluster_spec().task_address(r.job_name, r.task_index))[1]
