"""Monte Carlo pi across local devices (seed 002, example 2), one worker process per device.

    towerflow launch --nproc 2 examples/pi_multi_device.py              # laptop: two CPU workers
    towerflow launch --devices gpu:0,gpu:1 examples/pi_multi_device.py  # one worker per GPU

Each worker draws its samples on the device the launcher gave it (TOWERFLOW_DEVICE); worker 0
collects the counts and prints pi. Run without the launcher, it is the seed's single-process
loop: `python examples/pi_multi_device.py` draws on every local GPU, or, on a laptop, on four
logical CPU devices (`towerflow.configure(logical_devices={"CPU": 4})`).
"""

import argparse
import math
import os
import time

import torch

import towerflow

CHUNK = 1_000_000


@towerflow.function
def count_inside(n: int, seed: int, device: str = "") -> torch.Tensor:
    """Points of n uniform draws in the unit square inside the quarter circle, drawn on `device`."""
    device = device or os.environ.get("TOWERFLOW_DEVICE", "")
    torch.manual_seed(seed)
    with towerflow.device(device or None):
        inside = torch.zeros((), dtype=torch.int64)
        left = n
        while left > 0:
            m = min(CHUNK, left)
            xy = torch.rand(m, 2, dtype=torch.float64)  # placed on `device` by the scope
            inside = inside + (xy.pow(2).sum(1) <= 1.0).sum()
            left -= m
    return inside.cpu()


def single_process(samples: int) -> None:
    if not towerflow.is_gpu_available():
        towerflow.configure(logical_devices={"CPU": 4})
    devices = [d.short_name for d in towerflow.list_devices() if d.device_type == ("GPU" if towerflow.is_gpu_available() else "CPU")]
    start = time.perf_counter()
    counts = [count_inside(samples // len(devices), 1234 + i, d) for i, d in enumerate(devices)]
    report(sum(int(c) for c in counts), samples // len(devices) * len(devices), time.perf_counter() - start, devices)


def report(inside: int, samples: int, seconds: float, where) -> None:
    pi = 4.0 * inside / samples
    print(f"{len(where)} devices ({', '.join(where)}) drew {samples:,} samples in {seconds:.2f} s ({samples / seconds:,.0f} samples/s)")
    print(f"pi ~= {pi:.6f} (error {abs(pi - math.pi):.6f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[towerflow.cluster_flags()], allow_abbrev=False)
    parser.add_argument("--samples", type=int, default=10_000_000)
    args = parser.parse_args()
    if "TF_CONFIG" not in os.environ:
        single_process(args.samples)
        return
    server = towerflow.Server()
    if server.is_chief:
        workers = [t for t in server.cluster.tasks() if t.job == "worker"]
        n = args.samples // len(workers)
        start = time.perf_counter()
        futures = []
        for i, task in enumerate(workers):
            with towerflow.device(task):
                futures.append(count_inside.remote(n, 1234 + i))
        inside = sum(int(f.result()) for f in futures)
        report(inside, n * len(workers), time.perf_counter() - start, [str(t) for t in workers])
    server.join()


if __name__ == "__main__":
    main()
