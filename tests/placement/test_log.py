import logging

import torch
import torch.nn as nn

import towerflow
from towerflow.placement import mode

CPU0 = "/job:localhost/replica:0/task:0/device:CPU:0"


def test_seed_example_logs_each_op_in_tf_shape(caplog):
    caplog.set_level(logging.INFO, logger="towerflow.placement")
    towerflow.configure(log_device_placement=True)
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([1.0, 2.0, 3.0])
    c = a + b
    lines = [r.getMessage() for r in caplog.records if r.name == "towerflow.placement"]
    assert lines[0].startswith("Device mapping:\n" + CPU0 + " -> device: 0")
    assert lines[1:] == [f"Const: (Const): {CPU0}", f"Const_1: (Const): {CPU0}", f"add: (Add): {CPU0}"]
    assert c.tolist() == [2.0, 4.0, 6.0]


def test_records_carry_input_devices_and_bytes():
    towerflow.configure(logical_devices={"CPU": 2}, log_device_placement="summary")
    with towerflow.device("/cpu:0"):
        a = torch.ones(4)
    with towerflow.device("/cpu:1"):
        b = a * 2
    record = towerflow.placement_log().records[-1]
    assert record.op == "mul" and record.op_type == "Mul"
    assert record.device == "/job:localhost/replica:0/task:0/device:CPU:1"
    assert record.input_devices == ("/job:localhost/replica:0/task:0/device:CPU:1",)
    assert record.bytes_moved == 16
    assert "moved 16 B in" in record.line()
    assert b.tolist() == [2.0] * 4


def test_summary_only_mode_keeps_totals_but_prints_nothing(caplog):
    caplog.set_level(logging.INFO, logger="towerflow.placement")
    towerflow.configure(log_device_placement="summary")
    for _ in range(5):
        torch.ones(2) + 1
    assert not [r for r in caplog.records if r.name == "towerflow.placement"]
    summary = towerflow.placement_log().summary()
    assert summary.ops_per_device == {CPU0: 10}
    assert f"{CPU0}: 10 ops" in str(summary)


def test_log_turns_off_at_run_time_and_the_mode_leaves():
    towerflow.configure(log_device_placement="summary")
    torch.ones(1)
    towerflow.configure(log_device_placement=False)
    assert not mode._thread.installed
    torch.ones(1)
    assert len(towerflow.placement_log()) == 1


def test_filter_by_op_device_and_module():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    towerflow.configure(log_device_placement="summary", log_filter={"op": "^linear$"})
    model(torch.ones(1, 2))
    assert [r.op_type for r in towerflow.placement_log()] == ["Linear", "Linear"]
    assert [r.module for r in towerflow.placement_log()] == ["0", "2"]
    # The summary still counts every op, filtered or not: ones, linear, relu, linear.
    assert sum(towerflow.placement_log().summary().ops_per_device.values()) == 4
    towerflow.placement_log(clear=True)
    towerflow.configure(log_filter={"module": "^2$"})
    model(torch.ones(1, 2))
    assert [r.module for r in towerflow.placement_log()] == ["2"]
    towerflow.placement_log(clear=True)
    towerflow.configure(log_filter={"device": "GPU"})
    model(torch.ones(1, 2))
    assert len(towerflow.placement_log()) == 0


def test_clear_restarts_names_and_totals():
    towerflow.configure(log_device_placement="summary")
    torch.ones(1)
    first = towerflow.placement_log(clear=True)
    assert len(first) == 1
    torch.ones(1)
    assert towerflow.placement_log().records[0].op == "ones"


def test_metadata_calls_are_not_logged_as_ops():
    towerflow.configure(log_device_placement="summary")
    t = torch.ones(3)
    t.shape, t.dtype, t.size(0), t.device, repr(t)
    assert [r.op for r in towerflow.placement_log()] == ["ones"]


def test_records_are_bounded(monkeypatch):
    from towerflow.placement import log as placement_log_module

    monkeypatch.setattr(placement_log_module, "MAX_RECORDS", 5)
    placement_log_module.recorder.reset()
    towerflow.configure(log_device_placement="summary")
    for _ in range(20):
        torch.ones(1)
    log = towerflow.placement_log()
    assert len(log) == 5
    assert sum(log.summary().ops_per_device.values()) == 20


def test_a_strategy_made_with_the_log_on_starts_in_a_fresh_process():
    """The first strategy of a process makes its device table under the placement log: the table's own torch calls
    must not be logged, which would ask for the table being made (the process hung so)."""
    import subprocess
    import sys

    code = ("import towerflow\n"
            "towerflow.configure(log_device_placement='summary')\n"
            "print(towerflow.OneDeviceStrategy().device)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.split()[0] in ("cpu", "cuda:0"), done.stderr[-2000:]
