"""ps/worker/optimizer.py's `zero_grad`: the user's optimizer's face, clearing exactly what torch's would."""

from __future__ import annotations

import pytest
import torch

from towerflow.ps.worker.optimizer import PSOptimizer


def _model_and_grads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    return model


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_the_gradients_as_torch_optim_does(set_to_none):
    ours, theirs = _model_and_grads(), _model_and_grads()
    user = torch.optim.SGD(ours.parameters(), lr=0.1)
    PSOptimizer(user, None, None, list(ours.parameters()), None, None).zero_grad(set_to_none=set_to_none)
    torch.optim.SGD(theirs.parameters(), lr=0.1).zero_grad(set_to_none=set_to_none)
    for mine, ref in zip(ours.parameters(), theirs.parameters()):
        if set_to_none:
            assert mine.grad is None and ref.grad is None
        else:
            assert torch.equal(mine.grad, ref.grad) and not mine.grad.abs().sum()
            assert not mine.grad.requires_grad and mine.grad.grad_fn is None


def test_zero_grad_leaves_parameters_outside_the_optimizer_alone():
    model = _model_and_grads()
    first, second = model[0], model[1]
    user = torch.optim.SGD(first.parameters(), lr=0.1)  # the second layer is not the optimizer's
    PSOptimizer(user, None, None, list(model.parameters()), None, None).zero_grad()
    assert all(p.grad is None for p in first.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in second.parameters())


def test_zero_grad_detaches_a_gradient_that_has_a_graph():
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = (torch.ones(3, requires_grad=True) * 2)  # create_graph=True leaves such a gradient
    PSOptimizer(torch.optim.SGD([w], lr=0.1), None, None, [w], None, None).zero_grad(set_to_none=False)
    assert w.grad.grad_fn is None and not w.grad.requires_grad and not w.grad.abs().sum()
