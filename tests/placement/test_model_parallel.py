"""Seed 003's model parallelism: layers built under different device scopes train end to end."""

import torch
import torch.nn as nn

import towerflow
from towerflow.placement import mode

BATCH, STEPS = 32, 15


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * STEPS, 20, generator=g)
    y = (x[:, :5].sum(1) > 0).long()
    return x, y


def _build(devices):
    torch.manual_seed(1)
    with towerflow.device(devices[0]):
        first = nn.Sequential(nn.Linear(20, 32), nn.ReLU())
    with towerflow.device(devices[1]):
        second = nn.Linear(32, 2)
    return nn.Sequential(first, second)


def _train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _data()
    losses = []
    for step in range(STEPS):
        xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_two_logical_devices_train_to_the_same_losses_as_one():
    towerflow.configure(logical_devices={"CPU": 2}, log_device_placement="summary")
    split = _train(_build(["/cpu:0", "/cpu:1"]))
    moved = towerflow.placement_log().summary().bytes_moved
    towerflow.placement_log(clear=True)
    single = _train(_build(["/cpu:0", "/cpu:0"]))
    assert split == single
    assert split[-1] < split[0] * 0.8  # it learns
    # Each step's activations (BATCH x 32 float32) crossed from /cpu:0 to /cpu:1.
    assert moved == STEPS * BATCH * 32 * 4
    assert towerflow.placement_log().summary().bytes_moved == 0


def test_parameters_and_gradients_stay_on_their_logical_devices():
    towerflow.configure(logical_devices={"CPU": 2})
    model = _build(["/cpu:0", "/cpu:1"])
    _train(model)
    first, second = model[0][0], model[1]
    assert getattr(first.weight, mode.TAG) == 0 and getattr(second.weight, mode.TAG) == 1
    assert getattr(second.weight.grad, mode.TAG) == 1
    assert towerflow.DeviceSpec.parse("/cpu:1") == model[1]._towerflow_device
