"""benchmarks/_scaling_model.py: the protocol's model reproduces what the code and the runs show (store work of
the direct check growing as N², of the group watch as N; a loss noticed within the timeout plus a check)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _scaling_model as model  # noqa: E402

COSTS = model.StoreCosts({"get": 27.0, "add": 11.0, "set": 11.0, "check": 11.0, "multi_get": 15.0},
                         {"check": 0.2, "multi_get": 0.5}, round_trip=35.0)


def test_the_direct_check_reads_n_squared_keys_and_the_group_watch_n():
    direct = [model.total(model.steady_load(n, 1, group=False))[1] for n in (100, 1000)]
    group = [model.total(model.steady_load(n, 1, group=True))[1] for n in (100, 1000)]
    assert 90 < direct[1] / direct[0] < 110  # N² : 10x the tasks, ~100x the keys
    assert 8 < group[1] / group[0] < 12  # N
    calls_direct = model.total(model.steady_load(1000, 1, group=False))[0]
    assert abs(calls_direct - (1000 + 4 * 999 + 20)) < 1  # N beats + 4 calls per worker check + 20 per ps


def test_a_worker_makes_the_calls_the_runs_counted():
    """Per worker and second: 4 calls when checking directly, 9 in the group watch with three calls a tick and 5
    with one (its ticks and the verdicts), as the runs counted (benchmarks/results/scaling_by_method_2026-11-29.json
    at 16 and 32 tasks; scaling_batched_tick_2026-11-29.json at 64 and 128)."""
    for group, batched, per_worker in ((False, True, 4), (True, False, 9), (True, True, 5)):
        one, two = (model.total(model.steady_load(n, 1, group=group, batched_tick=batched))[0] for n in (64, 65))
        assert abs((two - one) - (per_worker + 1)) < 0.5  # one more worker: its calls and its beat


def test_a_loss_is_noticed_within_the_timeout_and_one_check():
    for group in (False, True):
        d = model.detection(128, 5.0, 0.001, group=group)
        assert 4.0 <= d["first"] <= d["med"] <= d["max"]
        assert d["max"] <= 5.0 + model.CHECK_EVERY + (model.WATCH_EVERY if group else 0) + 0.01
    assert model.detection(128, 5.0, 6.0)["med"] == float("inf")  # reads slower than the timeout: no verdict


def test_the_done_set_reread_is_linear_in_n_per_change_only_before_the_change_log():
    before = model.total(model.done_reread(1000, 1000, 1, batched=False))[0]
    after = model.total(model.done_reread(1000, 1000, 1, batched=True))[0]
    assert before == 2 * 1000 * 1000 and after == 2 * 1000


def test_the_store_saturates_sooner_with_the_direct_check():
    assert model.break_point(COSTS, group=False) < 1000 < model.break_point(COSTS, group=True)


def test_a_group_member_reads_a_published_loss_at_its_next_tick():
    d = model.detection(1000, 5.0, 0.001, group=True)
    assert d["max"] <= 5.0 + 2 * model.WATCH_EVERY + 0.01  # the watcher's look, then the member's tick that wakes it


def test_the_store_cpu_lies_between_calls_back_to_back_and_every_call_waking_the_loop():
    costs = model.StoreCosts(COSTS.cpu_call, COSTS.cpu_key, COSTS.round_trip, wake=40.0)
    load = model.steady_load(256, 1)
    low, high = costs.cpu_range(load)
    assert low == costs.cpu(load) and abs(high - low - 40e-6 * model.total(load)[0]) < 1e-9


def test_the_join_on_a_shared_host_is_its_cpu_and_on_a_host_per_task_the_protocol():
    host = model.Host(cores=2.0, tasks=512, task_cpu=0.0006, post_meet_cpu=0.008)
    alone = model.join_after_last_start(512, 0.001)
    shared = model.join_after_last_start(512, 0.001, host=host)
    assert alone < 0.5 and shared > alone + 512 * 0.008 / 2.0  # 4 s of CPU on two cores, less what the rest takes
    crowded = model.Host(cores=2.0, tasks=4096, task_cpu=0.0006, post_meet_cpu=0.008)
    assert model.join_after_last_start(4096, 0.001, host=crowded) == float("inf")  # the steady work alone fills it
