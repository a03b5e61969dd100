"""Seed 003's model parallelism: two halves of a model on two devices.

Run: python examples/model_parallel.py [--steps 200]
With two GPUs the halves go to /gpu:0 and /gpu:1; otherwise the CPU is split into two logical
devices (/cpu:0, /cpu:1) so the same code runs, and the placement summary shows the activations
crossing between the halves.
"""

import argparse

import torch
import torch.nn as nn

import towerflow

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

if sum(d.device_type == "GPU" for d in towerflow.list_devices()) >= 2:
    devices = ["/gpu:0", "/gpu:1"]
else:
    towerflow.configure(logical_devices={"CPU": 2})
    devices = ["/cpu:0", "/cpu:1"]
towerflow.configure(log_device_placement="summary")
torch.manual_seed(args.seed)

with towerflow.device(devices[0]):
    encoder = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
with towerflow.device(devices[1]):
    head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
model = nn.Sequential(encoder, head)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

# A synthetic task: which quadrant does the sum of two halves of x fall into.
generator = torch.Generator().manual_seed(args.seed)
x = torch.randn(args.batch_size * 50, 32, generator=generator)
y = (x[:, :16].sum(1) > 0).long() * 2 + (x[:, 16:].sum(1) > 0).long()

for step in range(args.steps):
    i = (step % 50) * args.batch_size
    xb, yb = x[i : i + args.batch_size], y[i : i + args.batch_size]
    logits = model(xb)
    loss = nn.functional.cross_entropy(logits, yb.to(logits.device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step % 50 == 0 or step == args.steps - 1:
        print(f"step {step:4d}  loss {loss.item():.4f}")

with torch.no_grad():
    logits = model(x)
    accuracy = (logits.argmax(1).cpu() == y).float().mean().item()
print(f"encoder on {devices[0]}, head on {devices[1]}")
print(f"train accuracy: {accuracy:.4f}")
print(towerflow.placement_log().summary())
