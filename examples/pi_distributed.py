"""Monte Carlo pi across a cluster (seed 002, example 3): each task draws samples, the client sums.

    towerflow launch --ps 1 --workers 2 examples/pi_distributed.py --samples 10000000

The chief (worker 0 here) is the client: it sends `count_inside` to every task with
`towerflow.remote`, the tasks draw their share of the samples in parallel, and the client
adds up the counts and prints pi and the samples per second. By hand, with the seeds' flags:

    python examples/pi_distributed.py --worker_hosts localhost:2222,localhost:2223 --job_name worker --task_index 1 &
    python examples/pi_distributed.py --worker_hosts localhost:2222,localhost:2223 --job_name worker --task_index 0
"""

import argparse
import math
import time

import torch

import towerflow

CHUNK = 1_000_000  # samples drawn per step, so memory stays small whatever --samples is


@towerflow.function
def count_inside(n: int, seed: int) -> torch.Tensor:
    """How many of n uniform points in the unit square fall inside the quarter circle."""
    g = torch.Generator().manual_seed(seed)
    inside = torch.zeros((), dtype=torch.int64)
    left = n
    while left > 0:
        m = min(CHUNK, left)
        xy = torch.rand(m, 2, generator=g, dtype=torch.float64)
        inside += (xy.pow(2).sum(1) <= 1.0).sum()
        left -= m
    return inside


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[towerflow.cluster_flags()], allow_abbrev=False)
    parser.add_argument("--samples", type=int, default=10_000_000, help="samples in all, split across the tasks")
    args = parser.parse_args()
    server = towerflow.Server()
    if server.is_chief:
        tasks = server.cluster.tasks()
        share = [args.samples // len(tasks) + (i < args.samples % len(tasks)) for i in range(len(tasks))]
        start = time.perf_counter()
        futures = []
        for i, task in enumerate(tasks):
            with towerflow.device(task):
                futures.append(count_inside.remote(share[i], seed=1234 + i))
        inside = sum(int(f.result()) for f in futures)
        seconds = time.perf_counter() - start
        pi = 4.0 * inside / args.samples
        print(f"{len(tasks)} tasks drew {args.samples:,} samples in {seconds:.2f} s ({args.samples / seconds:,.0f} samples/s)")
        print(f"pi ~= {pi:.6f} (error {abs(pi - math.pi):.6f})")
    server.join()


if __name__ == "__main__":
    main()
