"""ps/server/optimizers.py's `unhooked_step`: the same update as `optimizer.step()`, and the hooks still run."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from towerflow.ps.server.optimizers import unhooked_step


def _flat():
    return torch.zeros(50, requires_grad=True)


@pytest.mark.parametrize("cls, settings", [(torch.optim.SGD, dict(lr=0.1, momentum=0.9)), (torch.optim.Adam, dict(lr=0.01)),
                                           (torch.optim.Adagrad, dict(lr=0.1))])
def test_the_unhooked_step_updates_exactly_as_the_optimizers_own_step(cls, settings):
    ours, theirs = _flat(), _flat()
    mine, ref = cls([ours], **settings), cls([theirs], **settings)
    step = unhooked_step(mine)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        grad = torch.randn(50, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        step()
        ref.step()
    assert torch.equal(ours, theirs)
    assert ours.grad_fn is None  # the update ran without autograd recording it
    for key, value in ref.state[theirs].items():  # momentum, moments, step counts: the same
        assert torch.equal(torch.as_tensor(mine.state[ours][key]), torch.as_tensor(value)), key


def test_a_registered_hook_still_runs():
    flat = _flat()
    opt = torch.optim.SGD([flat], lr=0.1)
    seen = []
    opt.register_step_post_hook(lambda *_: seen.append("own"))
    handle = register_optimizer_step_pre_hook(lambda *_: seen.append("global"))
    try:
        flat.grad = torch.ones(50)
        unhooked_step(opt)()
    finally:
        handle.remove()
    assert seen == ["global", "own"]
    assert torch.allclose(flat.detach(), torch.full((50,), -0.1))
