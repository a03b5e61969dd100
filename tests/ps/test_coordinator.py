"""The coordinator stepped one transition at a time under each policy."""

from __future__ import annotations

import random

import pytest

from towerflow.errors import ParameterServerError
from towerflow.ps.messages import PolicySpec, Ticket
from towerflow.ps.server.coordinator import Collecting, Coordinator, Finished, Go, Open, Wait
from towerflow.ps.policies import (
    Apply,
    AsyncPolicy,
    Drop,
    Hold,
    PullRequest,
    SSPPolicy,
    SyncPolicy,
    make_policy,
)


def go(c, worker, clock=0, after_step=0):
    answer = c.pull(PullRequest(worker, clock, after_step))
    assert isinstance(answer, Go), answer
    return answer.ticket


# ---- async
def test_async_applies_every_push_and_counts_staleness_in_updates():
    c = Coordinator(AsyncPolicy(), 2)
    t0, t1 = go(c, 0), go(c, 1)
    assert c.push(0, t0) == Apply((0,), 1.0, 0)
    assert c.push(1, t1) == Apply((1,), 1.0, 1)  # one update landed since worker 1 pulled
    assert c.state == Open(2)
    assert c.metrics()["staleness_histogram"] == {0: 1, 1: 1}


def test_async_staleness_aware_lr_divides_by_staleness():
    c = Coordinator(AsyncPolicy(staleness_aware_lr=True), 3)
    tickets = [go(c, w) for w in range(3)]
    scales = [c.push(w, tickets[w]).lr_scale for w in range(3)]
    assert scales == [1.0, 1.0, 0.5]


# ---- sync
def test_sync_holds_until_enough_gradients_then_applies_their_mean_once():
    c = Coordinator(SyncPolicy(2, 3), 3)
    tickets = [go(c, w) for w in range(3)]
    assert c.push(0, tickets[0]) == Hold(1, 2)
    assert c.state == Collecting(0, (0,), 2)
    assert c.push(1, tickets[1]) == Apply((0, 1), 1.0, 0)
    assert c.state == Collecting(1, (), 2)
    # the backup worker's gradient of step 0 is now stale: dropped and counted
    assert c.push(2, tickets[2]) == Drop(0, 1)
    m = c.metrics()
    assert (m["applied_updates"], m["applied_gradients"], m["dropped_stale"], m["dropped_by_worker"]) == (1, 2, 1, {2: 1})


def test_sync_pull_waits_for_the_next_step_and_is_released_by_the_update():
    c = Coordinator(SyncPolicy(2, 2), 2)
    t = [go(c, 0), go(c, 1)]
    c.push(0, t[0])
    answer = c.pull(PullRequest(0, clock=1, after_step=1))
    assert isinstance(answer, Wait) and "step 1" in answer.reason
    assert c.released() == []
    c.push(1, t[1])
    (released,) = c.released()
    assert released.request.worker == 0 and released.ticket == Ticket(1)
    assert c.released() == []  # each release is handed out once


def test_sync_with_a_slow_worker_and_one_backup_never_waits_for_it():
    c = Coordinator(SyncPolicy(2, 3), 3)
    slow_ticket = go(c, 2)  # worker 2 pulls at step 0 and is never heard from for 10 steps
    for step in range(10):
        t = [go(c, w, clock=step, after_step=step) for w in (0, 1)]
        c.push(0, t[0])
        assert isinstance(c.push(1, t[1]), Apply)
    assert c.global_step == 10
    assert c.push(2, slow_ticket) == Drop(0, 10)
    assert c.metrics()["dropped_stale"] == 1


def test_sync_finish_lowers_what_a_step_needs_and_applies_a_full_held_set():
    c = Coordinator(SyncPolicy(2, 2), 2)
    t = [go(c, 0), go(c, 1)]
    assert isinstance(c.push(0, t[0]), Hold)
    assert c.finish(1) == Apply((0,), 1.0, 0)
    assert c.global_step == 1
    c.finish(0)
    assert c.state == Finished(1)


def test_sync_refuses_two_pushes_of_one_step_from_one_worker():
    c = Coordinator(SyncPolicy(2, 2), 2)
    t = go(c, 0)
    c.push(0, t)
    with pytest.raises(ParameterServerError, match="pushed twice"):
        c.push(0, t)


# ---- ssp
def _simulate(policy, num_workers, steps, speeds, seed=0):
    """Discrete-event run: each worker pulls, computes for `speed` ticks, pushes; returns the coordinator."""
    rng = random.Random(seed)
    c = Coordinator(policy, num_workers)
    clock = [0] * num_workers
    busy_until = {}  # worker -> (tick, ticket)
    blocked = set()
    waits = 0

    def start(w, tick):
        nonlocal waits
        if clock[w] >= steps:
            c.finish(w)
            return
        answer = c.pull(PullRequest(w, clock[w], after_step=0))
        if isinstance(answer, Go):
            busy_until[w] = (tick + speeds[w] + rng.random(), answer.ticket)
        else:
            blocked.add(w)
            waits += 1

    for w in range(num_workers):
        start(w, 0.0)
    while busy_until:
        w = min(busy_until, key=lambda k: busy_until[k][0])
        tick, ticket = busy_until.pop(w)
        action = c.push(w, ticket)
        assert isinstance(action, Apply)
        clock[w] += 1
        for go_ in c.released():
            blocked.discard(go_.request.worker)
            busy_until[go_.request.worker] = (tick + speeds[go_.request.worker] + rng.random(), go_.ticket)
        start(w, tick)
    assert not blocked, f"workers {blocked} never released"
    return c, waits


@pytest.mark.parametrize("k", [0, 1, 3])
def test_ssp_never_applies_a_gradient_staler_than_the_bound(k):
    c, waits = _simulate(SSPPolicy(k), 4, steps=30, speeds=[1.0, 1.0, 2.5, 7.0])
    m = c.metrics()
    assert m["max_staleness"] <= k
    assert m["applied_gradients"] == 4 * 30 and m["dropped_stale"] == 0
    assert waits > 0  # the fast workers did have to wait for the slowest


def test_ssp_bound_zero_keeps_workers_in_lockstep():
    c = Coordinator(SSPPolicy(0), 2)
    t = go(c, 0, clock=0)
    c.push(0, t)
    assert isinstance(c.pull(PullRequest(0, clock=1)), Wait)  # one clock ahead of worker 1
    t1 = go(c, 1, clock=0)
    c.push(1, t1)
    (released,) = c.released()
    assert released.request.worker == 0


def test_ssp_counts_its_own_push_in_flight_so_a_prefetching_worker_is_not_blocked_by_itself():
    c = Coordinator(SSPPolicy(1), 1)
    t = go(c, 0, clock=0)
    assert isinstance(c.pull(PullRequest(0, clock=1)), Go)  # push 0 not arrived yet, one worker: no one to wait for
    c.push(0, t)


def test_ssp_finished_worker_no_longer_holds_the_others_back():
    c = Coordinator(SSPPolicy(1), 2)
    for clock in range(2):
        c.push(0, go(c, 0, clock=clock))
    assert isinstance(c.pull(PullRequest(0, clock=2)), Wait)
    c.finish(1)
    assert [g.request.worker for g in c.released()] == [0]


def test_a_restarted_worker_that_had_finished_stays_finished():
    c = Coordinator(SyncPolicy(2, 2), 2)
    c.push(1, go(c, 1))  # held: waits for worker 0's gradient
    assert c.metrics()["held_from"] == [1]
    assert c.rejoin(1) is False  # back mid-round: its first push for this step will be dropped
    c.finish(0)
    assert c.rejoin(0) is True and 0 not in c.active  # killed after finish: it pushes no more
    assert isinstance(c.pull(PullRequest(0, clock=5)), Go)  # and reads the values without waiting


def test_unbounded_async_never_waits_and_staleness_grows_with_the_slow_worker():
    c, waits = _simulate(AsyncPolicy(), 3, steps=20, speeds=[1.0, 1.0, 8.0])
    assert waits == 0 and c.metrics()["max_staleness"] > 3


# ---- building policies
@pytest.mark.parametrize(
    "kwargs, cls, text",
    [
        (dict(mode="async", num_workers=1), AsyncPolicy, "async"),
        (dict(mode="sync", num_workers=3), SyncPolicy, "sync (3 of 3 replicas per update)"),
        (dict(mode="sync", num_workers=3, replicas_to_aggregate=2), SyncPolicy, "sync (2 of 3 replicas per update)"),
        (dict(mode="ssp", num_workers=1, staleness=2), SSPPolicy, "ssp (staleness bound 2)"),
        (dict(mode="async", num_workers=1, staleness_aware_lr=True), AsyncPolicy, "async (lr / staleness)"),
    ],
)
def test_make_policy(kwargs, cls, text):
    p = make_policy(PolicySpec(**kwargs))
    assert isinstance(p, cls) and p.describe() == text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="asynch", num_workers=1), "Did you mean 'async'"),
        (dict(mode="sync", num_workers=2, replicas_to_aggregate=3), "replicas_to_aggregate=3"),
        (dict(mode="ssp", num_workers=1, staleness=-1), "staleness=-1"),
    ],
)
def test_bad_policies_say_what_to_do(kwargs, match):
    with pytest.raises(ParameterServerError, match=match):
        make_policy(PolicySpec(**kwargs))


def test_unknown_worker_is_refused():
    with pytest.raises(ParameterServerError, match="workers 0..1"):
        Coordinator(AsyncPolicy(), 2).pull(PullRequest(5))
