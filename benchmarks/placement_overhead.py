"""Per-op cost of towerflow's placement layer against PyTorch's own `with torch.device(...)`.

All variants run interleaved in one process, round after round, and the medians are compared,
so machine noise hits every variant alike. Usage:

    .venv/bin/python benchmarks/placement_overhead.py [--rounds 15] [--ops 20000]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch
import torch.nn as nn

import towerflow


def _small_op(n):
    a = torch.ones(3)
    b = torch.ones(3)

    def run():
        for _ in range(n):
            a + b

    return run


def _mlp(n):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    x = torch.randn(32, 64)

    def run():
        with torch.no_grad():
            for _ in range(n):
                model(x)

    return run


@contextlib.contextmanager
def _summary_log():
    towerflow.configure(log_device_placement="summary")
    try:
        with towerflow.device("/cpu:0"):
            yield
    finally:
        towerflow.configure(log_device_placement=False)
        towerflow.placement_log(clear=True)


VARIANTS = {
    "plain PyTorch": contextlib.nullcontext,
    "with torch.device('cpu')": lambda: torch.device("cpu"),
    "with towerflow.device('/cpu:0')": lambda: towerflow.device("/cpu:0"),
    "towerflow scope + summary log": _summary_log,
}


def measure(workload, ops_per_round: int, rounds: int) -> dict:
    """Median seconds per op of each variant."""
    times = {name: [] for name in VARIANTS}
    run = workload(ops_per_round)
    for _ in range(rounds):
        for name, ctx in VARIANTS.items():
            with ctx():
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) / ops_per_round)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--ops", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch thread, torch {torch.__version__}, "
          f"python {platform.python_version()}, {args.rounds} rounds")
    for label, workload, n in (("a + b (3 floats)", _small_op, args.ops), ("MLP forward (3 Linear, batch 32)", _mlp, args.ops // 10)):
        medians = measure(workload, n, args.rounds)
        plain = medians["plain PyTorch"]
        torch_extra = medians["with torch.device('cpu')"] - plain
        print(f"\n{label}: median per op")
        print(f"  {'variant':34s} {'us/op':>8s} {'extra us':>9s} {'vs torch.device extra':>22s}")
        for name, t in medians.items():
            extra = t - plain
            ratio = f"{extra / torch_extra:.2f}x" if name != "plain PyTorch" and torch_extra > 0 else ""
            print(f"  {name:34s} {t * 1e6:8.2f} {extra * 1e6:9.2f} {ratio:>22s}")


if __name__ == "__main__":
    main()
