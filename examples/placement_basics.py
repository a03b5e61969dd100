"""Seed 000/001, section 12.1: where does each op run?  Run: python examples/placement_basics.py

1. a + b with the placement log on (TF's log_device_placement=True).
2. a and b pinned to /cpu:0, c = a + b to /gpu:0: on a machine without a GPU this raises
   PlacementError, and with allow_soft_placement=True it runs on the CPU and the log says why.
"""

import torch

import towerflow

towerflow.configure(log_device_placement=True)

# 1. Nothing pinned: PyTorch's default device, logged in TF's shape.
a = torch.tensor([1.0, 2.0, 3.0])
b = torch.tensor([1.0, 2.0, 3.0])
c = a + b
print(c)

# 2. Pinned with device scopes.
with towerflow.device("/cpu:0"):
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([1.0, 2.0, 3.0])
try:
    with towerflow.device("/gpu:0"):
        c = a + b
except towerflow.PlacementError as e:
    print(f"without soft placement: {e}")
    towerflow.configure(allow_soft_placement=True)
    with towerflow.device("/gpu:0"):
        c = a + b
print(c)
print(towerflow.placement_log().summary())
