"""train_step, the synchronous optimizer wrapper, evaluation, progress output and seeds on one device."""

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import towerflow
from towerflow.errors import StrategyError
from towerflow.training import piecewise_constant


def _setup(**kw):
    torch.manual_seed(0)
    strategy = towerflow.OneDeviceStrategy("/cpu:0")
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = strategy.setup(model, opt, **kw)
    data = TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,)))
    return strategy, model, opt, data


def test_global_step_schedule_and_clipping():
    strategy, model, opt, data = _setup(lr_schedule=piecewise_constant([1], [0.5, 0.25]), clip_grad_norm=1e-3)
    loader = strategy.distribute_loader(data, batch_size=5)
    lrs = []
    for batch in loader:
        before = [p.detach().clone() for p in model.parameters()]
        towerflow.train_step(strategy, model, opt, batch, F.cross_entropy)
        lrs.append(opt.param_groups[0]["lr"])
        step = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
        assert step.norm() <= lrs[-1] * 1e-3 * (1 + 1e-5)  # the clipped gradient bounds the update
    assert strategy.global_step == opt.global_step == 4
    assert lrs == [0.5, 0.5, 0.25, 0.25]
    assert opt.state_dict()["global_step"] == 4


def test_host_variables_on_one_device_train_like_device_variables():
    params = []
    for variables_on in ("device", "cpu"):
        torch.manual_seed(0)
        strategy = towerflow.OneDeviceStrategy("/cpu:0", variables_on=variables_on)
        model = torch.nn.Linear(4, 3)
        model, opt = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9))
        data = TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,)))
        for batch in strategy.distribute_loader(data, batch_size=5, seed=1):
            towerflow.train_step(strategy, model, opt, batch, F.cross_entropy)
        params.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*params):
        torch.testing.assert_close(p, q)


def test_step_with_closure_is_refused():
    _, _, opt, _ = _setup()
    with pytest.raises(StrategyError, match="closure"):
        opt.step(lambda: 0.0)


def test_evaluate_counts_every_test_sample():
    strategy, model, opt, data = _setup()
    metrics = towerflow.evaluate(strategy, model, strategy.distribute_loader(data, batch_size=7, shuffle=False), F.cross_entropy)
    x, y = data.tensors
    assert metrics["samples"] == 20
    assert metrics["accuracy"] == pytest.approx((model(x).argmax(1) == y).float().mean().item())
    assert metrics["loss"] == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-5)


class _RecordingStrategy:
    """The two things train_step asks of a strategy, recording the loss each backward got."""

    def __init__(self):
        self.backward_losses = []

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss):
        self.backward_losses.append(loss.item())
        loss.backward()


def _replica_loader(size, global_batch, replica):
    sampler = towerflow.data.ShardSampler(size, global_batch, 2, replica, shuffle=False)
    data = TensorDataset(torch.randn(size, 4), torch.randint(0, 3, (size,)))
    weigh = lambda b: len(b.indices) * 2 / b.global_size  # noqa: E731  (the synchronous strategies' share)
    return towerflow.data.DistributedLoader(data, sampler, torch.device("cpu"), weigh=weigh)


def test_a_held_batch_keeps_its_own_weight_while_another_loader_runs():
    """Evaluating (or reading ahead) between taking a batch and training it must not reweigh it."""
    strategy, model = _RecordingStrategy(), torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_batch = next(iter(_replica_loader(8, 4, replica=1)))  # 2 of 4 samples: weight 1
    uneven = list(_replica_loader(7, 4, replica=1))  # its tail: 1 of 3 samples, weight 2/3
    loss = towerflow.train_step(strategy, model, opt, train_batch, F.cross_entropy)
    assert strategy.backward_losses == [pytest.approx(loss.item())]
    x, y = uneven[-1]
    expected = F.cross_entropy(model(x), y).item() * 2 / 3
    towerflow.train_step(strategy, model, opt, uneven[-1], F.cross_entropy)
    assert strategy.backward_losses[1] == pytest.approx(expected)


def test_an_empty_batch_still_steps_with_a_zero_loss():
    strategy, model = _RecordingStrategy(), torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    empty = list(_replica_loader(5, 4, replica=1))[-1]  # a tail of 1 sample over 2 replicas: none for replica 1
    assert towerflow.batch_facts(empty).is_empty
    towerflow.train_step(strategy, model, opt, empty, F.cross_entropy)
    assert strategy.backward_losses == [0.0] and all(p.grad is not None for p in model.parameters())


def test_progress_prints_plain_lines_off_a_terminal():
    strategy, model, opt, data = _setup()
    out = io.StringIO()
    with towerflow.Progress(strategy, 4, log_every=2, stream=out) as progress:
        for batch in strategy.distribute_loader(data, batch_size=5):
            progress.update(towerflow.train_step(strategy, model, opt, batch, F.cross_entropy))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("train step 4/4") and "samples/s total" in lines[-1]
    assert progress.global_samples == 15 and progress.samples_per_sec > 0


def test_progress_draws_a_bar_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    strategy, *_ = _setup()
    out = Tty()
    with towerflow.Progress(strategy, 3, stream=out) as progress:
        for _ in range(3):
            progress.update(0.5)
    assert "3/3" in out.getvalue()


def test_print_only_on_the_chief(capsys):
    strategy, *_ = _setup()
    strategy.print("hello")
    strategy.replica_id = 1
    strategy.print("not me")
    assert capsys.readouterr().out == "hello\n"


def test_set_seed_makes_runs_repeat():
    towerflow.set_seed(3)
    a = torch.randn(3)
    towerflow.set_seed(3)
    assert torch.equal(a, torch.randn(3))


def test_same_seed_same_training_run():
    def run(seed):
        towerflow.set_seed(seed)
        strategy = towerflow.OneDeviceStrategy("/cpu:0")
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))
        model, opt = strategy.setup(model, torch.optim.Adam(model.parameters()))
        data = TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,)))
        for batch in strategy.distribute_loader(data, batch_size=8, seed=seed):
            towerflow.train_step(strategy, model, opt, batch, F.cross_entropy)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))
