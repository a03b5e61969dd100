"""benchmarks/_scaling_model.py: the protocol's model reproduces what the code and the runs show (store work of
the direct check growing as N², of the group watch as N; a loss noticed within the timeout plus a check; the
store's CPU at a load's rate; the join, simulated, on a host per task and on shared cores)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _scaling_model as model  # noqa: E402
from _scaling_join import JoinCosts, fair_share, simulate  # noqa: E402

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


def test_the_store_cpu_under_load_follows_the_calibrated_cost_per_call_at_the_loads_rate():
    """At a calibrated rate a load of the calibration's own mix costs that rate's figure per call; between two rates
    the figure lies between theirs; past the fastest, the back-to-back cost and a bound."""
    costs = model.StoreCosts(COSTS.cpu_call, COSTS.cpu_key, COSTS.round_trip, wake=40.0,
                             under_load=((400.0, 40.0), (3200.0, 20.0)))
    mix_at = lambda rate: model.scaled(model.CALIBRATION_MIX, rate / model.total(model.CALIBRATION_MIX)[0])  # noqa: E731
    figure, bound = costs.cpu_loaded(mix_at(400.0))
    assert abs(figure - 400.0 * 40e-6) < 1e-9 and figure == bound
    between = costs.cpu_loaded(mix_at(1600.0))[0] / 1600.0
    assert 20e-6 < between < 40e-6
    low, high = costs.cpu_loaded(mix_at(10_000.0))
    assert low == costs.cpu(mix_at(10_000.0)) and abs(high - 10_000.0 * 20e-6) < 1e-9


def _join_costs(post_meet_cpu: float = 0.008) -> "JoinCosts":
    return JoinCosts(meet_cpu=0.007, post_meet_cpu=post_meet_cpu, poll_cpu=150e-6, task_cpu=0.001, poll_store=20e-6,
                     post_store=100e-6)


def test_the_join_on_a_host_per_task_is_the_last_tasks_work_and_two_polls():
    alone = simulate(512, _join_costs(), cores=512, shared=False, store_steady=0.05)
    assert 0.007 + 0.008 < alone <= 0.007 + 0.008 + 2 * 0.1 + 0.02


def test_the_join_on_shared_cores_is_its_cpu_and_grows_with_each_tasks_work():
    shared = simulate(512, _join_costs(), cores=2.0, shared=True, store_steady=0.05)
    assert shared > 512 * 0.008 / 2.0  # 4 s of CPU on two cores, and the polls besides
    assert simulate(512, _join_costs(0.016), cores=2.0, shared=True, store_steady=0.05) > 1.8 * shared


def test_a_store_already_saturated_never_answers_the_join():
    assert simulate(64, _join_costs(), cores=64, shared=False, store_steady=1.0) == float("inf")


def test_a_step_shares_its_capacity_fairly_and_what_a_short_job_leaves_goes_to_the_others():
    need = np.array([0.1e-3, 5e-3, 5e-3, 0.2e-3])
    got = fair_share(need, capacity=2e-3, cap=1e-3)
    assert np.allclose(got, [0.1e-3, 0.85e-3, 0.85e-3, 0.2e-3])  # 2 ms of capacity used in full
    assert np.allclose(fair_share(need, capacity=20e-3, cap=1e-3), [0.1e-3, 1e-3, 1e-3, 0.2e-3])  # one core at most


def test_the_simulated_join_does_not_depend_on_the_step():
    """Store calls far shorter than a step used to hold the store (and the cores it shares with the tasks) for a whole
    step each."""
    costs = JoinCosts(meet_cpu=0.007, post_meet_cpu=0.0085, poll_cpu=165e-6, task_cpu=0.001, poll_store=23e-6,
                      post_store=114e-6)
    coarse = simulate(64, costs, cores=2.0, shared=True, store_steady=0.014, dt=1e-3)
    fine = simulate(64, costs, cores=2.0, shared=True, store_steady=0.014, dt=1e-4)
    assert abs(coarse - fine) < 0.03 * fine
