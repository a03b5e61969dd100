"""The placement tour: device mapping, the seed's logged a + b, soft placement, and a model
split over two logical devices. `towerflow demo` runs this until the cluster demo replaces it."""

from __future__ import annotations

import logging
import sys
import time

import torch
import torch.nn as nn

import towerflow


def _section(title: str) -> None:
    print(f"\n== {title}")


def main() -> int:
    started = time.perf_counter()
    # The log goes to stderr by default; here it joins stdout so the tour reads in order.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("towerflow.placement").addHandler(handler)
    towerflow.configure(logical_devices={"CPU": 2})
    _section("log_device_placement: the device mapping, then c = a + b")
    towerflow.configure(log_device_placement=True)
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([1.0, 2.0, 3.0])
    print(a + b)

    _section("soft placement: /gpu:0 asked for")
    towerflow.configure(allow_soft_placement=True)
    with towerflow.device("/gpu:0"):
        c = a * 2
    print(f"ran on {c.device} ({'a GPU' if towerflow.is_gpu_available() else 'no GPU here: the CPU, as logged'})")

    _section("model parallel over /cpu:0 and /cpu:1 (summary only)")
    towerflow.configure(log_device_placement="summary")
    towerflow.placement_log(clear=True)
    torch.manual_seed(0)
    with towerflow.device("/cpu:0"):
        first = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
    with towerflow.device("/cpu:1"):
        second = nn.Linear(32, 2)
    model = nn.Sequential(first, second)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    x = torch.randn(256, 8)
    y = (x.sum(1) > 0).long()
    for _ in range(100):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    accuracy = (model(x).argmax(1) == y).float().mean().item()
    print(f"loss {loss.item():.4f}, train accuracy {accuracy:.4f}")
    print(towerflow.placement_log().summary())
    towerflow.configure(log_device_placement=False)
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
