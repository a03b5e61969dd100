"""Soft placement for ops with no kernel on the requested device, shown with a custom op
that has only a CPU kernel on a fake GPU (PyTorch's meta device)."""

import pytest
import torch

import towerflow
from towerflow import PlacementError

_lib = torch.library.Library("towerflow_test", "DEF")
_lib.define("cpu_only(Tensor x) -> Tensor")
_lib.impl("cpu_only", lambda x: x * 10, "CPU")
cpu_only = torch.ops.towerflow_test.cpu_only


def test_missing_kernel_without_soft_placement_names_op_device_and_fix(fake_gpu):
    x = torch.ones(2)
    with pytest.raises(PlacementError) as info:
        with towerflow.device("/gpu:0"):
            cpu_only(x)
    err = info.value
    assert err.requested == "/device:GPU:0"
    assert "no kernel on /device:GPU:0" in str(err)
    assert "allow_soft_placement=True" in str(err)


def test_missing_kernel_with_soft_placement_runs_on_cpu_and_logs_why(fake_gpu):
    towerflow.configure(allow_soft_placement=True, log_device_placement="summary")
    x = torch.ones(2)
    with towerflow.device("/gpu:0"):
        y = cpu_only(x)
    assert y.device.type == "cpu"
    assert y.tolist() == [10.0, 10.0]
    record = towerflow.placement_log().records[-1]
    assert record.device.endswith("/device:CPU:0")
    assert record.requested == "/device:GPU:0"
    assert record.fallback.startswith("no kernel on /device:GPU:0")


def test_ops_that_have_the_kernel_stay_on_the_device(fake_gpu):
    towerflow.configure(allow_soft_placement=True)
    with towerflow.device("/gpu:0"):
        y = torch.ones(2) * 3
    assert y.device == fake_gpu


def test_real_errors_are_not_swallowed_by_soft_placement(fake_gpu):
    towerflow.configure(allow_soft_placement=True)
    with pytest.raises(RuntimeError, match="size"):
        with towerflow.device("/cpu:0"):
            torch.ones(2) + torch.ones(3)
