"""The worker's side of the wire without a network: packing gradients and installing pulled values."""

from __future__ import annotations

import pytest
import torch

from towerflow.ps import plan_layout
from towerflow.ps.messages import Ticket
from towerflow.ps.worker.channel import Channel


def _params():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(11, 3), torch.nn.Linear(3, 2))
    return dict(m.named_parameters())


def test_gather_packs_every_tasks_pieces_like_the_layout_and_reuses_its_buffers():
    params = _params()
    layout = plan_layout(params, 2, partition={"0.weight": 2})
    for p in params.values():
        p.grad = torch.randn_like(p)
    params["1.bias"].grad = None  # a parameter without a gradient pushes zeros
    grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in params.items()}
    for task in range(2):
        ch = Channel(task, layout, params, torch.device("cpu"))
        first = ch.gather(0)
        assert [torch.equal(a, b) for a, b in zip(first, layout.pack(task, grads).values())] == [True] * len(first)
        assert first[0].data_ptr() == ch.gather(0)[0].data_ptr()  # the same buffer every other step
        assert first[0].data_ptr() != ch.gather(1)[0].data_ptr()


def test_install_puts_pulled_values_into_the_parameters():
    params = _params()
    layout = plan_layout(params, 3, "greedy", partition={"0.weight": 3})
    ptrs = {k: p.data_ptr() for k, p in params.items()}
    objects = dict(params)
    new = {k: torch.randn_like(p) for k, p in params.items()}
    for task in range(3):
        ch = Channel(task, layout, params, torch.device("cpu"))
        ch.install(Ticket(7), list(layout.pack(task, new).values()), torch.device("cpu"))
        assert ch.ticket == Ticket(7)
    for k, p in params.items():
        assert torch.equal(p.detach(), new[k]) and p is objects[k]
    assert params["0.weight"].data_ptr() == ptrs["0.weight"]  # row shards are copied in place


@pytest.mark.gpu
def test_gradients_computed_on_the_gpu_are_pushed_from_pinned_buffers_and_pulled_back_onto_it():
    device = torch.device("cuda")
    params = {k: torch.nn.Parameter(p.detach().to(device)) for k, p in _params().items()}
    layout = plan_layout(params, 2, partition={"0.weight": 2})
    for p in params.values():
        p.grad = torch.randn_like(p)
    grads_cpu = {k: p.grad.cpu() for k, p in params.items()}
    new = {k: torch.randn(p.shape) for k, p in params.items()}
    for task in range(2):
        ch = Channel(task, layout, params, device)
        flats = ch.gather(0)
        assert all(f.is_pinned() for f in flats)
        assert all(torch.equal(a, b) for a, b in zip(flats, layout.pack(task, grads_cpu).values()))
        ch.install(Ticket(1), list(layout.pack(task, new).values()), device)
    for k, p in params.items():
        assert p.device.type == "cuda" and torch.equal(p.detach().cpu(), new[k])
