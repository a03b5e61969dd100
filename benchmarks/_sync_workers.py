"""The two replica programs `benchmarks/sync_vs_ddp.py` races: `towerflow` and `ddp` (hand-written).

Both train the same model on the same data with the same global batch and process count,
time the same steps after the same warm-up, and print one JSON line on rank 0. They differ only
in who does the work: towerflow's strategy, loader and train_step, or plain torch code.

    python benchmarks/_sync_workers.py {towerflow,ddp} --steps N --warmup W --batch-size B [--data PATH]
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from mnist_sync import build_model  # noqa: E402  the example's CNN, the same for both variants

from towerflow.data import load_mnist_or_digits  # noqa: E402


def _data(path):
    if path:
        return load_mnist_or_digits(path).train.tensors
    g = torch.Generator().manual_seed(0)  # MNIST-shaped synthetic data when no path is given
    return torch.randn(8000, 1, 28, 28, generator=g), torch.randint(0, 10, (8000,), generator=g)


def _report(variant, world, steps, batch, seconds, device):
    print(json.dumps({"variant": variant, "replicas": world, "steps": steps, "global_batch": batch,
                      "seconds": seconds, "samples_per_sec": steps * batch / seconds, "device": str(device)}),
          flush=True)


def run_towerflow(args):
    import towerflow

    towerflow.set_seed(0)
    strategy = towerflow.strategy_from_env()
    x, y = _data(args.data)
    model = build_model(28)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, opt = strategy.setup(model, opt)
    loader = strategy.distribute_loader(torch.utils.data.TensorDataset(x, y), global_batch_size=args.batch_size)
    batches = loader.forever()
    for _, batch in zip(range(args.warmup), batches):
        towerflow.train_step(strategy, model, opt, batch, F.cross_entropy)
    strategy.barrier()
    start = time.perf_counter()
    for _, batch in zip(range(args.steps), batches):
        towerflow.train_step(strategy, model, opt, batch, F.cross_entropy)
    if strategy.device.type == "cuda":
        torch.cuda.synchronize()
    strategy.barrier()
    seconds = time.perf_counter() - start
    if strategy.is_chief:
        _report("towerflow", strategy.num_replicas_in_sync, args.steps, args.batch_size, seconds, strategy.device)
    strategy.shutdown()


def run_ddp(args):
    """What a user would write by hand: env:// process group, DDP, a sharded index per step."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif world > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    x, y = _data(args.data)
    model = nn.parallel.DistributedDataParallel(
        build_model(28).to(device), device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    per = args.batch_size // world
    epoch = [0]

    def batches():
        while True:
            g = torch.Generator().manual_seed(epoch[0])
            order = torch.randperm(len(x), generator=g)
            for s in range(len(x) // args.batch_size):
                idx = order[s * args.batch_size + rank * per : s * args.batch_size + (rank + 1) * per]
                xb, yb = x[idx], y[idx]
                if device.type == "cuda":
                    xb, yb = xb.pin_memory().to(device, non_blocking=True), yb.pin_memory().to(device, non_blocking=True)
                yield xb, yb
            epoch[0] += 1

    def step(xb, yb):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        opt.step()

    it = batches()
    for _, (xb, yb) in zip(range(args.warmup), it):
        step(xb, yb)
    dist.barrier()
    start = time.perf_counter()
    for _, (xb, yb) in zip(range(args.steps), it):
        step(xb, yb)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        _report("ddp", world, args.steps, args.batch_size, seconds, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("variant", choices=["towerflow", "ddp"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--data", default=None)
    a = p.parse_args()
    (run_towerflow if a.variant == "towerflow" else run_ddp)(a)
