"""Local steps (geo-SGD) without processes: the ps adds deltas (async, sync, ssp), a worker takes k steps of its
own optimizer and pushes the delta, and bad settings fail with the value, what was expected and the fix."""

from __future__ import annotations

import pytest
import torch

from towerflow import taskenv
from towerflow.cli import build_parser
from towerflow.errors import ParameterServerError
from towerflow.ps import plan_layout
from towerflow.ps.messages import PushPull, RowPush
from towerflow.ps.messages import Ticket
from towerflow.ps.policies import AsyncPolicy, SSPPolicy, SyncPolicy
from towerflow.ps.server.service import ShardService
from towerflow.ps.worker.local_steps import check_local_steps
from towerflow.ps.worker.optimizer import PSOptimizer


def _values(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 3, generator=g), "b": torch.randn(3, generator=g)}


def _service(policy, num_workers, values=None):
    values = values or _values()
    layout = plan_layout(values, 1)
    svc = ShardService(layout.on_task(0), layout.pack(0, values), torch.optim.Adam, dict(lr=0.1), policy, num_workers)
    return svc, layout


def _flat(svc, layout, tensors):
    packed = layout.pack(0, tensors)
    return [packed[d] for d in svc.dtypes]


def _ticket(svc, worker=0, clock=0, after_step=0):
    return svc.pull(worker, clock, after_step).wait().ticket


# ---- the ps side
def test_async_delta_is_added_to_the_values_without_the_optimizer():
    svc, layout = _service(AsyncPolicy(), num_workers=1)
    before = [f.clone() for f in svc.flats]
    delta = _flat(svc, layout, _values(seed=1))
    outcome = svc.push(0, _ticket(svc), delta, kind="delta")
    assert (outcome.kind, outcome.global_step) == ("applied", 1)
    assert all(torch.equal(f, b + d) for f, b, d in zip(svc.flats, before, delta))
    assert svc.optimizer.state == {}  # Adam never stepped: no moments
    assert svc.push_kind == "delta"


def test_async_delta_of_one_of_two_workers_counts_half_and_finished_peers_do_not_count():
    svc, layout = _service(AsyncPolicy(), num_workers=2)
    before = [f.clone() for f in svc.flats]
    delta = _flat(svc, layout, _values(seed=1))
    svc.push(0, _ticket(svc), delta, kind="delta")
    assert all(torch.allclose(f, b + d / 2) for f, b, d in zip(svc.flats, before, delta))
    svc.finish(1).wait()  # worker 1 is done: worker 0's deltas now land in full
    middle = [f.clone() for f in svc.flats]
    svc.push(0, _ticket(svc), delta, kind="delta")
    assert all(torch.allclose(f, m + d) for f, m, d in zip(svc.flats, middle, delta))


def test_sync_two_of_two_applies_the_mean_of_the_deltas_once_both_arrived():
    svc, layout = _service(SyncPolicy(2, 2), num_workers=2)
    before = [f.clone() for f in svc.flats]
    d0, d1 = _flat(svc, layout, _values(seed=1)), _flat(svc, layout, _values(seed=2))
    ticket = _ticket(svc)
    assert svc.push(0, ticket, d0, kind="delta").kind == "held"
    assert all(torch.equal(f, b) for f, b in zip(svc.flats, before))
    reply = svc.push_pull(PushPull(1, ticket, d1, None, clock=1, after_step=1, kind="delta")).wait()
    assert (reply.outcome.kind, reply.outcome.global_step) == ("applied", 1)
    assert all(torch.allclose(f, b + (x + y) / 2) for f, b, x, y in zip(svc.flats, before, d0, d1))
    assert svc.coordinator.applied_gradients == 2 and svc.optimizer.state == {}


def test_a_delta_is_one_push_for_ssp_clocks_and_bounds():
    svc, layout = _service(SSPPolicy(0), num_workers=2)
    delta = _flat(svc, layout, _values(seed=1))
    svc.push(0, _ticket(svc, 0, 0), delta, kind="delta")
    assert svc.coordinator.clocks == {0: 1, 1: 0} and svc.coordinator.global_step == 1
    waiting = svc.pull(0, clock=1)  # bulk-synchronous: worker 0 waits for worker 1's first push
    assert not waiting.done()
    svc.push(1, _ticket(svc, 1, 0), delta, kind="delta")
    assert waiting.done() and svc.coordinator.clocks == {0: 1, 1: 1}


def test_the_ps_refuses_an_unknown_kind_a_mix_of_kinds_and_a_delta_with_rows():
    svc, layout = _service(AsyncPolicy(), num_workers=2)
    grads = _flat(svc, layout, _values(seed=1))
    with pytest.raises(ParameterServerError, match=r"kind='gradient'; expected one of \('grad', 'delta'\)"):
        svc.push(0, _ticket(svc), grads, kind="gradient")
    rows = RowPush(("t",), (torch.tensor([0]),), (torch.zeros(1, 2),))
    with pytest.raises(ParameterServerError, match="delta with table rows"):
        svc.push(0, _ticket(svc), grads, rows=rows, kind="delta")
    svc.push(0, _ticket(svc), grads, kind="grad")
    with pytest.raises(ParameterServerError, match="every worker must train with the same local_steps"):
        svc.push(1, _ticket(svc, 1), grads, kind="delta")
    assert svc.coordinator.pushes_by_worker[1] == 0  # refused before the coordinator counted it


# ---- the worker side, with a client that calls a ShardService in this process
class _Channel:
    def __init__(self):
        self.ticket = Ticket(0)


class _FakeClient:
    """PSClient's face for PSOptimizer: push_pull packs the .grad slots, pushes them, installs copies of the values."""

    def __init__(self, svc, layout, params, worker=0):
        self.svc, self.layout, self.params, self.worker = svc, layout, params, worker
        self.channels = [_Channel()]
        self.finished = False
        self.pushed = []
        self.install()

    @property
    def global_step(self):
        return self.channels[0].ticket.step

    def install(self):
        pulled = self.svc.pull(self.worker).wait()
        with torch.no_grad():
            for name, value in self.svc.values().items():
                self.params[name].copy_(value)
        self.channels[0].ticket = pulled.ticket

    def push_pull(self, lr, row_grads=None, kind="grad"):
        grads = {name: p.grad.clone() for name, p in self.params.items()}
        self.pushed.append((lr, kind, grads))
        self.svc.push(self.worker, self.channels[0].ticket, _flat(self.svc, self.layout, grads), lr, kind=kind)
        self.install()


class _Recovery:
    @staticmethod
    def guarded(op, retry=True):
        return op()


def _loss(params, x):
    return ((x @ params["w"] + params["b"]) ** 2).mean()


def test_a_worker_takes_k_local_steps_then_pushes_its_delta_and_keeps_its_optimizer_state():
    values = _values()
    svc, layout = _service(AsyncPolicy(), num_workers=1, values=values)
    params = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in values.items()}
    client = _FakeClient(svc, layout, params)
    user = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    opt = PSOptimizer(user, client, _Recovery(), list(params.values()), lambda step: 0.05 / (1 + step), None,
                      local_steps=3)
    twin = {k: v.clone().requires_grad_(True) for k, v in values.items()}  # the same steps, taken by hand
    twin_opt = torch.optim.SGD(twin.values(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    assert opt.has_local_steps
    for i in range(6):
        x = torch.randn(4, 6, generator=g)
        for ps, o in ((params, opt), (twin, twin_opt)):
            o.zero_grad()
            _loss(ps, x).backward()
        for group in twin_opt.param_groups:
            group["lr"] = 0.05 / (1 + i // 3)  # the schedule reads the global step: one per push
        opt.step()
        twin_opt.step()
        assert len(client.pushed) == (i + 1) // 3 and svc.coordinator.global_step == (i + 1) // 3
        assert all(p.grad is None for p in params.values()) or i % 3 != 2  # the delta slots are cleared
    assert [(lr, kind) for lr, kind, _ in client.pushed] == [(None, "delta")] * 2
    for name in values:  # one worker: the ps's values are the worker's after its 6 local steps
        assert torch.allclose(svc.values()[name], twin[name].detach(), atol=1e-6), name
        assert torch.allclose(params[name].detach(), twin[name].detach(), atol=1e-6), name
    assert all("momentum_buffer" in user.state[p] for p in params.values())  # local state survived the installs


def test_a_worker_measures_its_delta_from_values_installed_behind_its_back():
    values = _values()
    svc, layout = _service(AsyncPolicy(), num_workers=1, values=values)
    params = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in values.items()}
    client = _FakeClient(svc, layout, params)
    opt = PSOptimizer(torch.optim.SGD(params.values(), lr=0.1), client, _Recovery(), list(params.values()), None,
                      None, local_steps=2)
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step()  # one local step of a round of two
    with torch.no_grad():
        svc.flats[0].add_(1.0)  # e.g. a checkpoint was loaded on the ps: a recovery installs it
    client.install()
    installed = {k: v.detach().clone() for k, v in params.items()}
    for _ in range(2):  # a round starts at the install: its second step pushes only these steps' change
        assert not client.pushed
        for p in params.values():
            p.grad = torch.ones_like(p)
        opt.step()
    delta = client.pushed[-1][2]
    assert all(torch.allclose(delta[k], torch.full_like(delta[k], -0.2)) for k in delta)
    assert all(torch.allclose(svc.values()[k], installed[k] - 0.2) for k in values)


# ---- bad settings
@pytest.mark.parametrize("bad", [0, -2, 2.5, "4", True])
def test_local_steps_must_be_a_whole_number_of_at_least_one(bad):
    with pytest.raises(ParameterServerError, match=r"local_steps=.*expected a whole number k >= 1.*local_steps=4"):
        check_local_steps(bad)
    assert check_local_steps(None) == 1 and check_local_steps(1) == 1 and check_local_steps(8) == 8


@pytest.mark.parametrize("bad", ["0", "-1", "2.5", "four"])
def test_launch_refuses_a_bad_local_steps_value_with_the_fix(bad, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["launch", "--ps", "1", "--workers", "2", f"--local-steps={bad}", "train.py"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --local_steps/--local-steps: {bad!r}: expected a whole number of local steps K >= 1" in err
    assert "e.g. --local-steps 4" in err


def test_the_task_environment_carries_local_steps_and_refuses_a_bad_value():
    assert taskenv.read({taskenv.ENV_PS_LOCAL_STEPS: "4"}).ps.local_steps == 4
    assert taskenv.read({}).ps.local_steps is None
    with pytest.raises(taskenv.TaskEnvironmentError, match=r"TOWERFLOW_PS_LOCAL_STEPS='0'.*expected a positive integer"):
        taskenv.read({taskenv.ENV_PS_LOCAL_STEPS: "0"})


def test_launch_hands_local_steps_to_every_task_and_wants_ps_tasks(monkeypatch):
    from towerflow.cli.launch import config_of
    from towerflow.errors import TowerflowError
    from towerflow.launch.planning import pass_ps_mode

    monkeypatch.delenv(taskenv.ENV_PS_LOCAL_STEPS, raising=False)
    monkeypatch.delenv(taskenv.ENV_PS_MODE, raising=False)
    args = config_of(build_parser().parse_args(["launch", "--workers", "2", "--local-steps", "4", "train.py"]))
    with pytest.raises(TowerflowError, match=r"--local-steps 4 chooses how parameter servers apply updates; add --ps N"):
        pass_ps_mode(args, has_ps=False)
    monkeypatch.setenv(taskenv.ENV_PS_LOCAL_STEPS, "")  # restored after the test, as is what the launch exports
    pass_ps_mode(args, has_ps=True)
    assert taskenv.from_environment().ps.local_steps == 4 and taskenv.from_environment().ps.mode is None
