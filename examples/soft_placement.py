"""Seed 000/003: allow_soft_placement.  Run: python examples/soft_placement.py

TF's example puts an int variable on /gpu:0. Here: an int64 matmul, which CUDA has no kernel
for, and a tensor asked for on /gpu:0. With soft placement both run on the CPU and the log says
why; without it towerflow raises PlacementError naming the op, the device and the fix.
"""

import torch

import towerflow

towerflow.configure(log_device_placement=True, allow_soft_placement=True)

a_cpu = torch.zeros((), dtype=torch.int64)
with towerflow.device("/gpu:0"):
    a_gpu = torch.zeros((), dtype=torch.int64)  # a GPU when there is one, else the CPU
    ints = torch.ones(4, 4, dtype=torch.int64)
    product = ints @ ints  # no int64 matmul kernel on CUDA: runs on the CPU
print(f"a_gpu is on {a_gpu.device}, the int64 matmul ran on {product.device}")

fallbacks = [r for r in towerflow.placement_log() if r.fallback]
for record in fallbacks:
    print(f"fell back: {record.op} ({record.op_type}) asked for {record.requested}: {record.fallback}")

towerflow.configure(allow_soft_placement=False, log_device_placement=False)
try:
    with towerflow.device("/gpu:0"):
        ints @ ints
    print("no PlacementError: this GPU build has an int64 matmul kernel")
except towerflow.PlacementError as e:
    print(f"without soft placement: {e}")
