import pytest
import torch

import towerflow
from towerflow.devices import logical, physical


@pytest.fixture
def fake_gpu(monkeypatch):
    """A 'GPU' backed by PyTorch's meta device: placement, moves and missing kernels without hardware."""
    devices = [
        physical.PhysicalDevice("CPU", 0, "cpu", "cpu"),
        physical.PhysicalDevice("GPU", 0, "meta", "FakeGPU", 1 << 30),
    ]
    monkeypatch.setattr(physical, "discover", lambda: devices)
    monkeypatch.setattr(logical, "_physical_for_check", lambda new: devices)
    towerflow.configure(allow_soft_placement=False)  # rebuilds the device table
    yield torch.device("meta")
    logical._table = None
