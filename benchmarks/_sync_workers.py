"""One replica of `benchmarks/sync_vs_ddp.py`: towerflow and a hand-written DDP loop, side by side.

Both train the same model (examples/mnist_sync.py's CNN, each its own copy from the same
seed) on the same data with the same global batch, in the same processes, over the same
process group. They alternate in chunks of `--chunk` steps (order swapped every round), so
whatever else the machine is doing hits both alike; rank 0 prints one JSON line with every
chunk's samples/s.

    torchrun --nproc-per-node N benchmarks/_sync_workers.py --rounds R --chunk K --batch-size B [--data PATH]
"""

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from mnist_sync import build_model  # noqa: E402  the example's CNN

import towerflow  # noqa: E402
from towerflow.data import load_mnist_or_digits  # noqa: E402


def _data(path):
    if path:
        return load_mnist_or_digits(path).train.tensors
    g = torch.Generator().manual_seed(0)  # MNIST-shaped synthetic data when no path is given
    return torch.randn(8000, 1, 28, 28, generator=g), torch.randint(0, 10, (8000,), generator=g)


def towerflow_steps(strategy, x, y, batch_size):
    """The towerflow user's code: strategy.setup, distribute_loader, train_step."""
    torch.manual_seed(0)
    model = build_model(28)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, opt = strategy.setup(model, opt)
    batches = strategy.distribute_loader(TensorDataset(x, y), global_batch_size=batch_size).forever()

    def run(k):
        for _, batch in zip(range(k), batches):
            towerflow.train_step(strategy, model, opt, batch, F.cross_entropy)

    return run


def ddp_steps(x, y, batch_size):
    """What a user writes by hand: env:// process group, DDP, a sharded index per step."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if not dist.is_initialized():  # one process: towerflow needs no group, DDP does
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        build_model(28).to(device), device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    per = batch_size // world

    def batches():
        epoch = 0
        while True:
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
            for s in range(len(x) // batch_size):
                idx = order[s * batch_size + rank * per : s * batch_size + (rank + 1) * per]
                xb, yb = x[idx], y[idx]
                if device.type == "cuda":
                    xb, yb = xb.pin_memory().to(device, non_blocking=True), yb.pin_memory().to(device, non_blocking=True)
                yield xb, yb
            epoch += 1

    it = batches()

    def run(k):
        for _, (xb, yb) in zip(range(k), it):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb), yb).backward()
            opt.step()

    return run


def _timed(run, k, device):
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    run(k)
    if device.type == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--chunk", type=int, default=20, help="steps per timed chunk")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=128, help="global batch size")
    p.add_argument("--data", default=None)
    args = p.parse_args()

    strategy = towerflow.strategy_from_env()
    x, y = _data(args.data)
    runs = {"towerflow": towerflow_steps(strategy, x, y, args.batch_size), "ddp": ddp_steps(x, y, args.batch_size)}
    for run in runs.values():
        run(args.warmup)
    rates = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in (("ddp", "towerflow") if r % 2 == 0 else ("towerflow", "ddp")):
            rates[name].append(args.chunk * args.batch_size / _timed(runs[name], args.chunk, strategy.device))
    if strategy.is_chief:
        print(json.dumps({"replicas": strategy.num_replicas_in_sync, "threads": torch.get_num_threads(),
                          "device": str(strategy.device), "samples_per_sec": rates}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
