"""Parameter-server training on a real cluster: 1 ps + 3 workers, every mode in one launch.

`_cluster_scenarios.py` trains one small model per scenario on the same cluster (worker 2
slowed on purpose where the scenario says so) and writes what each worker and the ps saw.
"""

from __future__ import annotations

import json

import pytest
import torch

import _cluster_scenarios as scenarios
from _launch import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

DELAY = 0.15  # seconds worker 2 sleeps per step when slowed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps-cluster")
    launch(["--ps", "1", "--workers", "3", scenarios.__file__, "--out", str(out), "--delay", str(DELAY)], timeout=240)
    workers = [json.loads((out / f"worker-{i}.json").read_text()) for i in range(3)]
    return json.loads((out / "chief.json").read_text()), workers


def _reference_allreduce(num_workers: int, steps: int):
    """What the all-reduce strategies compute: every replica's gradient averaged, one local update per step."""
    model = scenarios.build_model()
    opt = scenarios.make_optimizer(model)
    for step in range(steps):
        grads = []
        for w in range(num_workers):
            x, y = scenarios.batch(step, w, num_workers)
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / num_workers
        opt.step()
    return dict(model.named_parameters())


def test_sync_with_all_replicas_gives_the_all_reduce_parameters(results):
    chief, _ = results
    run = chief["sync_all"]
    assert run["global_step"] == scenarios.STEPS_EQUIV
    assert chief["restored_step"] == scenarios.STEPS_EQUIV  # the ps state saved and restored through the optimizer
    expected = _reference_allreduce(3, scenarios.STEPS_EQUIV)
    for name, value in run["variables"].items():
        torch.testing.assert_close(torch.tensor(value), expected[name].detach(), rtol=0, atol=1e-6)


def test_a_backup_worker_makes_the_slow_worker_harmless_and_its_stale_gradients_are_dropped(results):
    chief, workers = results
    slow_rate = 1 / DELAY
    all_rate = chief["sync_all_slow"]["global_step"] / workers[0]["sync_all_slow"]["elapsed"]
    backup_rate = chief["sync_backup"]["global_step"] / workers[0]["sync_backup"]["elapsed"]
    assert all_rate < 1.2 * slow_rate  # without a backup, every step waits for the slow worker
    assert backup_rate > 3 * slow_rate, (backup_rate, slow_rate)
    ps = chief["sync_backup"]["ps"]
    assert ps["applied_updates"] == chief["sync_backup"]["global_step"] >= 30
    assert ps["dropped_by_worker"].get("2", 0) >= 1 and ps["dropped_stale"] == sum(ps["dropped_by_worker"].values())
    assert workers[2]["sync_backup"]["pushes_dropped"] >= 1


def test_bounded_staleness_never_applies_a_gradient_staler_than_k(results):
    chief, workers = results
    ps = chief["ssp1"]["ps"]
    assert ps["max_staleness"] <= 1 and max(int(s) for s in ps["staleness_histogram"]) <= 1
    assert ps["applied_gradients"] == 3 * 15 and ps["dropped_stale"] == 0
    assert workers[0]["ssp1"]["pull_wait_s"] > 0.5 * 15 * DELAY  # the fast workers were held back


def test_async_applies_everything_with_unbounded_staleness(results):
    chief, workers = results
    ps = chief["async"]["ps"]
    assert ps["applied_gradients"] == 3 * 15 and ps["dropped_stale"] == 0
    assert ps["max_staleness"] > 1  # the slowed worker's gradients are many updates old
    for w in workers:
        m = w["async"]
        assert m["bytes_pushed"]["/job:ps/task:0"] == m["steps"] * 4 * sum(
            p.numel() for p in scenarios.build_model().parameters())
