import threading

import pytest
import torch
import torch.nn as nn

import towerflow
from towerflow import PlacementError
from towerflow.placement import mode


def test_factories_and_ops_land_on_the_scoped_device(fake_gpu):
    with towerflow.device("/gpu:0"):
        a = torch.ones(3)
        b = torch.tensor([1.0, 2.0, 3.0])
    assert a.device == fake_gpu and b.device == fake_gpu
    cpu = torch.ones(3)
    with towerflow.device("/gpu:0"):
        c = cpu + cpu
    assert c.device == fake_gpu


def test_inputs_from_elsewhere_are_moved_and_counted(fake_gpu):
    x = torch.zeros(1000)  # 4000 bytes on the host
    towerflow.placement_log(clear=True)
    with towerflow.device("/gpu:0"):
        y = x * 2
    assert y.device == fake_gpu
    summary = towerflow.placement_log().summary()
    assert summary.bytes_moved == 4000
    assert summary.host_to_device_bytes == 4000
    assert summary.device_to_host_bytes == 0
    with towerflow.device("/gpu:0"):
        y + 1  # already there: nothing moves
    assert towerflow.placement_log().summary().bytes_moved == 4000


def test_explicit_device_argument_wins_over_the_scope(fake_gpu):
    with towerflow.device("/gpu:0"):
        t = torch.zeros(2, device="cpu")
    assert t.device.type == "cpu"


def test_modules_built_in_a_scope_get_their_parameters_there(fake_gpu):
    with towerflow.device("/gpu:0"):
        layer = nn.Linear(3, 4)
    assert layer.weight.device == fake_gpu and layer.bias.device == fake_gpu


def test_in_place_ops_stay_on_the_tensor_they_mutate(fake_gpu):
    x = torch.zeros(3)
    with towerflow.device("/gpu:0"):
        x.add_(1)
    assert x.device.type == "cpu"
    assert x.tolist() == [1.0, 1.0, 1.0]


def test_nested_scopes_merge_like_tf(cpu_only):
    towerflow.configure(logical_devices={"CPU": 2}, log_device_placement="summary")
    with towerflow.device("/job:localhost/task:0"):
        with towerflow.device("/cpu:1"):
            torch.ones(1)
        torch.ones(1)  # the outer partial spec: first GPU, else the CPU
    devices = [r.device for r in towerflow.placement_log()]
    assert devices == [
        "/job:localhost/replica:0/task:0/device:CPU:1",
        "/job:localhost/replica:0/task:0/device:CPU:0",
    ]


def test_device_function_is_called_per_op():
    towerflow.configure(logical_devices={"CPU": 3}, log_device_placement="summary")
    seen = []

    def by_type(op):
        seen.append(op.type)
        return "/cpu:2" if op.type == "Mul" else None

    with towerflow.device("/cpu:1"):
        with towerflow.device(by_type):
            a = torch.ones(2)
            b = a * 3
    placed = {r.op_type: r.device[-5:] for r in towerflow.placement_log()}
    assert placed == {"Ones": "CPU:1", "Mul": "CPU:2"}
    assert seen == ["Ones", "Mul"]
    assert b.tolist() == [3.0, 3.0]


def test_device_function_can_place_variables_apart_from_ops():
    # replica_device_setter's idea: parameters on one device, the rest on another.
    towerflow.configure(logical_devices={"CPU": 2}, log_device_placement="summary")
    with towerflow.device(lambda op: "/cpu:1" if op.type == "Variable" else "/cpu:0"):
        layer = nn.Linear(2, 2)
    assert getattr(layer.weight, mode.TAG) == 1


def test_absent_device_without_soft_placement_raises_with_what_exists():
    with pytest.raises(PlacementError) as info:
        with towerflow.device("/gpu:1"):
            torch.ones(2)
    err = info.value
    assert err.op == "ones" and err.requested == "/device:GPU:1"
    assert "/device:CPU:0" in err.available
    assert "allow_soft_placement=True" in str(err)


def test_absent_device_with_soft_placement_runs_on_the_cpu_and_says_why():
    towerflow.configure(allow_soft_placement=True, log_device_placement="summary")
    with towerflow.device("/device:TPU:0"):
        t = torch.ones(2) + 1
    assert t.device.type == "cpu"
    records = towerflow.placement_log().records
    assert all(r.device.endswith("/device:CPU:0") for r in records)
    assert all(r.requested == "/device:TPU:0" and "no /device:TPU:0" in r.fallback for r in records)
    assert towerflow.placement_log().summary().fallbacks == 2


def test_a_plug_in_type_this_machine_lacks_is_refused_naming_the_types_it_has(fake_gpu):
    with pytest.raises(PlacementError) as info:
        with towerflow.device("/device:MyFunnyDevice:0"):
            torch.ones(2)
    err = info.value
    assert err.requested == "/device:MyFunnyDevice:0" and err.available == ("/device:CPU:0", "/device:GPU:0")
    assert ("this task has no /device:MyFunnyDevice:0: it has no device of type 'MyFunnyDevice' (device types: CPU, "
            "GPU; devices: /device:CPU:0, /device:GPU:0)") in str(err)
    assert "allow_soft_placement=True" in str(err)


def test_a_mistyped_device_type_is_refused_with_the_type_it_resembles(fake_gpu):
    with pytest.raises(PlacementError, match="no device of type 'GPX'.* Did you mean 'GPU'"):
        with towerflow.device("/device:GPX:0"):
            torch.ones(2)


def test_a_plug_in_type_under_soft_placement_runs_on_the_cpu_and_says_why():
    towerflow.configure(allow_soft_placement=True, log_device_placement="summary")
    with towerflow.device("/job:localhost/device:MyFunnyDevice:2"):
        t = torch.ones(2)
    assert t.device.type == "cpu"
    record = towerflow.placement_log().records[-1]
    assert record.device.endswith("/device:CPU:0") and record.requested == "/device:MyFunnyDevice:2"
    assert "no device of type 'MyFunnyDevice' (device types: CPU" in record.fallback


def test_scope_naming_another_task_is_refused_with_the_fix():
    with pytest.raises(PlacementError, match="towerflow.function"):
        with towerflow.device("/job:ps/task:0"):
            torch.ones(1)


def test_malformed_scope_fails_before_entering():
    with pytest.raises(ValueError, match="(?i)did you mean 'gpu'"):
        with towerflow.device("/gpo:0"):
            pass


def test_scope_is_per_thread():
    towerflow.configure(logical_devices={"CPU": 2})
    seen = {}

    def other_thread():
        seen["tag"] = getattr(torch.ones(1), mode.TAG, None)

    with towerflow.device("/cpu:1"):
        inside = torch.ones(1)
        t = threading.Thread(target=other_thread)
        t.start()
        t.join(10)
    assert getattr(inside, mode.TAG) == 1
    assert seen == {"tag": None}


def test_no_mode_is_installed_outside_scopes_with_the_log_off():
    assert not mode._thread.installed
    with towerflow.device("/cpu:0"):
        assert mode._thread.installed
    assert not mode._thread.installed


def test_scope_composes_with_torch_device_context():
    with towerflow.device("/cpu:0"):
        with torch.device("meta"):
            t = torch.ones(1)
    assert not mode._thread.installed
    assert t.device.type in ("meta", "cpu")


def test_default_device_auto_picks_first_gpu_else_cpu(cpu_only):
    towerflow.configure(default_device="auto", logical_devices={"CPU": 2}, log_device_placement="summary")
    torch.ones(1)
    assert towerflow.placement_log().records[0].device.endswith("/device:CPU:0")
    towerflow.configure(default_device=None, log_device_placement=False)
    assert not mode._thread.installed
