import json
import subprocess
import sys

import pytest
import torch

import towerflow
from towerflow.devices import logical, physical


def test_cpu_is_always_listed_with_its_full_name_and_memory():
    devices = towerflow.list_devices()
    cpu = devices[0]
    assert cpu.name == "/job:localhost/replica:0/task:0/device:CPU:0"
    assert cpu.torch_device == torch.device("cpu")
    assert cpu.memory_bytes and cpu.memory_bytes > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")
def test_gpu_helpers_on_a_cpu_only_machine():
    assert towerflow.gpu_device_name() == ""
    assert towerflow.is_gpu_available() is False
    assert [d.device_type for d in towerflow.list_devices()] == ["CPU"]


def test_logical_cpus_are_distinct_placement_targets(cpu_only):
    towerflow.configure(logical_devices={"CPU": 3})
    names = [d.name for d in towerflow.list_devices()]
    assert names == [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(3)]
    assert all(d.is_split and d.torch_device.type == "cpu" for d in towerflow.list_devices())


def test_logical_gpu_numbering_follows_tf(monkeypatch):
    # Two physical GPUs, the first split in two: /gpu:0 and /gpu:1 on cuda:0, /gpu:2 on cuda:1.
    fake = [
        physical.PhysicalDevice("CPU", 0, "cpu", "cpu"),
        physical.PhysicalDevice("GPU", 0, "cuda:0", "Tesla P40", 24 << 30, (6, 1), "0000:02:00.0"),
        physical.PhysicalDevice("GPU", 1, "cuda:1", "Tesla P40", 24 << 30, (6, 1), "0000:03:00.0"),
    ]
    monkeypatch.setattr(physical, "discover", lambda: fake)
    monkeypatch.setattr(logical, "_physical_for_check", lambda new: fake)
    towerflow.configure(logical_devices={"GPU:0": [1024, 2048]})
    gpus = [d for d in towerflow.list_devices() if d.device_type == "GPU"]
    assert [(d.index, str(d.torch_device), d.memory_bytes) for d in gpus] == [
        (0, "cuda:0", 1024 << 20),
        (1, "cuda:0", 2048 << 20),
        (2, "cuda:1", 24 << 30),
    ]
    assert towerflow.gpu_device_name() == "/device:GPU:0"
    mapping = towerflow.device_mapping()
    assert "/job:localhost/replica:0/task:0/device:GPU:2 -> device: 1, name: Tesla P40, pci bus id: 0000:03:00.0, compute capability: 6.1" in mapping
    assert "logical device of GPU:0" in mapping


def test_task_identity_comes_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("TOWERFLOW_JOB_NAME", "worker")
    monkeypatch.setenv("TOWERFLOW_TASK_INDEX", "1")
    logical._table = None
    try:
        assert towerflow.list_devices()[0].name == "/job:worker/replica:0/task:1/device:CPU:0"
    finally:
        logical._table = None


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "towerflow", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_devices_json_lists_the_cpu():
    result = _cli("devices", "--json")
    assert result.returncode == 0, result.stderr
    devices = json.loads(result.stdout)
    assert devices[0]["name"] == "/job:localhost/replica:0/task:0/device:CPU:0"
    assert devices[0]["torch_device"] == "cpu"


def test_cli_devices_prints_tf_device_mapping():
    result = _cli("devices")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Device mapping:\n/job:localhost/replica:0/task:0/device:CPU:0 -> device: 0")


def test_becoming_a_task_renames_devices_and_replaces_cached_placements(monkeypatch, cpu_only):
    monkeypatch.delenv("TOWERFLOW_JOB_NAME", raising=False)
    monkeypatch.delenv("TOWERFLOW_TASK_INDEX", raising=False)
    towerflow.list_devices()  # cache the table as /job:localhost
    with towerflow.device("/job:localhost/task:0"):
        torch.ones(1)
    monkeypatch.setenv("TOWERFLOW_JOB_NAME", "localhost")  # monkeypatch restores these afterwards
    monkeypatch.setenv("TOWERFLOW_TASK_INDEX", "0")
    try:
        logical.set_local_task("worker", 1)
        assert towerflow.list_devices()[0].name == "/job:worker/replica:0/task:1/device:CPU:0"
        with towerflow.device("/job:worker/task:1"):
            assert torch.ones(1).device.type == "cpu"
        with pytest.raises(towerflow.PlacementError, match="another task"):
            with towerflow.device("/job:localhost/task:0"):
                torch.ones(1)
    finally:
        logical.set_local_task("localhost", 0)
