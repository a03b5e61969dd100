"""The ps-side service without a network: optimizer state on the ps matches a local optimizer exactly."""

from __future__ import annotations

import pickle

import pytest
import torch

from towerflow.errors import ParameterServerError
from towerflow.ps import plan_layout
from towerflow.ps.messages import EarlierWorkers, Rejoined
from towerflow.ps.policies import AsyncPolicy, SSPPolicy, SyncPolicy
from towerflow.ps.server.service import ShardService


def _model_values(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(50, 8, generator=g),
        "w": torch.randn(8, 4, generator=g),
        "b": torch.randn(4, generator=g),
        "scale": torch.randn((), generator=g),
    }


def _services(layout, values, opt_cls, kwargs, policy_fn, num_workers=1):
    return [
        ShardService(layout.on_task(t), layout.pack(t, values), opt_cls, kwargs, policy_fn(), num_workers)
        for t in range(layout.num_ps)
    ]


def _assembled(layout, services):
    by_name = {}
    for t, svc in enumerate(services):
        by_name.update(svc.values())
    return {v: layout.assemble(v, [by_name[s.name] for s in layout.shards_of(v)]) for v in layout.variables}


def _pull_ticket(svc, worker=0, clock=0, after_step=0):
    return svc.pull(worker, clock, after_step).wait().ticket


OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (torch.optim.Adagrad, dict(lr=0.8)),
    (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99))),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
]


@pytest.mark.parametrize("opt_cls, kwargs", OPTIMIZERS, ids=lambda x: getattr(x, "__name__", ""))
def test_many_async_steps_on_sharded_ps_match_a_local_optimizer_exactly(opt_cls, kwargs):
    values = _model_values()
    layout = plan_layout(values, 3, "greedy", partition={"emb": 3})
    services = _services(layout, values, opt_cls, kwargs, AsyncPolicy)
    local = {k: v.clone().requires_grad_(True) for k, v in values.items()}
    local_opt = opt_cls(list(local.values()), **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in values.items()}
        for t, svc in enumerate(services):
            ticket = _pull_ticket(svc)
            packed = layout.pack(t, grads)
            outcome = svc.push(0, ticket, [packed[d] for d in svc.dtypes])
            assert (outcome.kind, outcome.staleness) == ("applied", 0)
        for k, p in local.items():
            p.grad = grads[k]
        local_opt.step()
    got = _assembled(layout, services)
    for k in values:
        assert torch.equal(got[k], local[k].detach()), k
    assert all(svc.coordinator.global_step == 200 for svc in services)


def test_sync_update_is_the_mean_of_the_aggregated_gradients_and_drops_the_stale_one():
    values = _model_values()
    layout = plan_layout(values, 1)
    (svc,) = _services(layout, values, torch.optim.Adagrad, dict(lr=0.8), lambda: SyncPolicy(2, 3), num_workers=3)
    local = {k: v.clone().requires_grad_(True) for k, v in values.items()}
    local_opt = torch.optim.Adagrad(list(local.values()), lr=0.8)
    g = torch.Generator().manual_seed(2)
    for step in range(20):
        tickets = [_pull_ticket(svc, w, step, step) for w in range(2)]
        grads = [{k: torch.randn(v.shape, generator=g) for k, v in values.items()} for _ in range(2)]
        kinds = [svc.push(w, tickets[w], list(layout.pack(0, grads[w]).values())).kind for w in range(2)]
        assert kinds == ["held", "applied"]
        for k, p in local.items():
            p.grad = (grads[0][k] + grads[1][k]) / 2
        local_opt.step()
    stale = svc.push(2, tickets[0].__class__(0), list(layout.pack(0, grads[0]).values()))
    assert (stale.kind, stale.staleness, stale.global_step) == ("dropped", 20, 20)
    got = _assembled(layout, [svc])
    for k in values:
        assert torch.equal(got[k], local[k].detach()), k
    m = svc.metrics()
    assert (m["applied_updates"], m["dropped_stale"], m["dropped_by_worker"]) == (20, 1, {2: 1})
    assert m["bytes_pushed_by_worker"][0] == 20 * 4 * (50 * 8 + 8 * 4 + 4 + 1)


def test_waiting_pull_completes_when_the_step_advances():
    values = _model_values()
    layout = plan_layout(values, 1)
    (svc,) = _services(layout, values, torch.optim.SGD, dict(lr=0.1), lambda: SyncPolicy(2, 2), num_workers=2)
    t0, t1 = _pull_ticket(svc, 0), _pull_ticket(svc, 1)
    grads = list(layout.pack(0, {k: torch.ones_like(v) for k, v in values.items()}).values())
    svc.push(0, t0, grads)
    pending = svc.pull(0, clock=1, after_step=1)
    assert not pending.done()
    svc.push(1, t1, grads)
    pulled = pending.wait()
    assert pulled.ticket.step == 1
    assert torch.allclose(pulled.values[0], layout.pack(0, values)[torch.float32] - 0.1)


def test_ssp_pull_waits_for_the_slowest_worker_and_finish_releases_it():
    values = _model_values()
    layout = plan_layout(values, 1)
    (svc,) = _services(layout, values, torch.optim.SGD, dict(lr=0.1), lambda: SSPPolicy(1), num_workers=2)
    grads = list(layout.pack(0, {k: torch.ones_like(v) for k, v in values.items()}).values())
    for clock in range(2):
        svc.push(0, _pull_ticket(svc, 0, clock), grads)
    pending = svc.pull(0, clock=2)
    assert not pending.done()
    svc.finish(1)
    assert pending.done()


def test_service_refuses_non_elementwise_optimizers_and_mismatched_pushes():
    values = _model_values()
    layout = plan_layout(values, 1)
    with pytest.raises(ParameterServerError, match="elementwise"):
        _services(layout, values, torch.optim.LBFGS, {}, AsyncPolicy)
    (svc,) = _services(layout, values, torch.optim.SGD, dict(lr=0.1), AsyncPolicy)
    with pytest.raises(ParameterServerError, match="same model"):
        svc.push(0, _pull_ticket(svc), [torch.zeros(3)])


def test_a_finish_that_overtakes_the_last_push_waits_for_it():
    values = _model_values()
    layout = plan_layout(values, 1)
    (svc,) = _services(layout, values, torch.optim.SGD, dict(lr=0.1), lambda: SSPPolicy(0), num_workers=2)
    grads = list(layout.pack(0, {k: torch.ones_like(v) for k, v in values.items()}).values())
    t = _pull_ticket(svc, 0)
    prefetched = svc.pull(0, clock=1)  # waits: worker 1 has not pushed
    finished = svc.finish(0, pushes_sent=1)
    assert not finished.done()  # its push is still on the way
    svc.push(0, t, grads)
    assert finished.wait() == 1 and prefetched.done()
    assert svc.coordinator.active == [1]


def test_staleness_aware_lr_divides_the_step_by_the_staleness():
    values = {"w": torch.zeros(3)}
    layout = plan_layout(values, 1)
    (svc,) = _services(layout, values, torch.optim.SGD, dict(lr=1.0), lambda: AsyncPolicy(staleness_aware_lr=True), 3)
    tickets = [_pull_ticket(svc, w) for w in range(3)]  # all read step 0
    for w in range(3):
        svc.push(w, tickets[w], [torch.ones(3)])
    # staleness 0, 1, 2 -> steps of 1, 1, 1/2
    assert torch.equal(svc.values()["w"], torch.full((3,), -2.5))
    assert svc.optimizer.param_groups[0]["lr"] == 1.0  # the scale is per update, not kept


def test_a_restored_checkpoint_continues_exactly_as_the_uninterrupted_run():
    values = _model_values()
    layout = plan_layout(values, 1)
    (svc,) = _services(layout, values, torch.optim.Adam, dict(lr=1e-2), AsyncPolicy)
    g = torch.Generator().manual_seed(3)
    grads = [list(layout.pack(0, {k: torch.randn(v.shape, generator=g) for k, v in values.items()}).values())
             for _ in range(15)]
    for grad in grads[:10]:
        svc.push(0, _pull_ticket(svc), grad)
    saved = pickle.loads(pickle.dumps(svc.state_dict()))  # as it would travel and be stored
    for grad in grads[10:]:
        svc.push(0, _pull_ticket(svc), grad)
    expected = {k: v.clone() for k, v in svc.values().items()}
    assert svc.load_state_dict(saved) == 10
    for grad in grads[10:]:
        svc.push(0, _pull_ticket(svc), grad)
    assert all(torch.equal(svc.values()[k], expected[k]) for k in expected)
    other = plan_layout({"x": torch.zeros(2)}, 1)
    (stranger,) = _services(other, {"x": torch.zeros(2)}, torch.optim.Adam, dict(lr=1e-2), AsyncPolicy)
    with pytest.raises(ParameterServerError, match="same model"):
        stranger.load_state_dict(saved)


def test_a_checkpoint_of_another_worker_count_hands_every_old_workers_clock_to_the_new_workers():
    """A ps restored with 3 workers' clocks in a job of 2 keeps all three (the new workers read on from them),
    counts the new workers from 0, and keeps the old clocks through its own checkpoints."""
    values = {"w": torch.zeros(3)}
    layout = plan_layout(values, 1)
    (old,) = _services(layout, values, torch.optim.SGD, dict(lr=0.1), AsyncPolicy, num_workers=3)
    for worker, pushes in ((0, 4), (1, 7), (2, 1)):
        for _ in range(pushes):
            old.push(worker, _pull_ticket(old, worker), [torch.ones(3)])
    saved = pickle.loads(pickle.dumps(old.state_dict()))
    (new,) = _services(layout, values, torch.optim.SGD, dict(lr=0.1), AsyncPolicy, num_workers=2)
    assert new.load_state_dict(saved) == 12
    assert new.rejoin(1, restarted=False) == Rejoined(12, 0, False, (EarlierWorkers(3, (4, 7, 1)),))
    for _ in range(5):
        new.push(1, _pull_ticket(new, 1), [torch.ones(3)])
    again = pickle.loads(pickle.dumps(new.state_dict()))
    (restored,) = _services(layout, values, torch.optim.SGD, dict(lr=0.1), AsyncPolicy, num_workers=2)
    restored.load_state_dict(again)
    assert restored.rejoin(1, restarted=False) == Rejoined(17, 5, False, (EarlierWorkers(3, (4, 7, 1)),))
    (three,) = _services(layout, values, torch.optim.SGD, dict(lr=0.1), AsyncPolicy, num_workers=3)
    three.load_state_dict(again)  # and back to 3 workers: both restores are kept, oldest first
    assert three.rejoin(0, restarted=False).earlier == (EarlierWorkers(3, (4, 7, 1)), EarlierWorkers(2, (0, 5)))
    damaged = {**saved, "clocks": {0: 4, 2: 1, 5: 7}}
    with pytest.raises(ParameterServerError, match=r"clocks name workers \[0, 2, 5\]: expected workers 0\.\.2"):
        new.load_state_dict(damaged)
