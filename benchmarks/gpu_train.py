"""Training on one GPU against plain PyTorch side by side in one process.

Parts (`--parts sync prefetch`), each a set of variants run in turn in chunks of `--chunk` steps,
the order rotating every round, so the machine's noise hits every variant alike; reported: samples/s
(median over rounds) and the median of the per-round ratios to the baseline named first.

  sync      the seed's CIFAR-10 network (examples/cifar10_towers.py, batch `--batch` of 3x32x32, synthetic,
            already on the device), per precision in `--precisions` (fp32, bf16, fp16; autocast, and a
            GradScaler for fp16):
              plain      the hand-written loop: zero_grad, forward under autocast, backward, step
              towerflow  `towerflow.OneDeviceStrategy(mixed_precision=...)` + `strategy.setup` + `towerflow.train_step`
              ddp        the plain loop around DistributedDataParallel in a process group of one (NCCL on a GPU)
  prefetch  host -> device flow: batches of `--image` x `--image` RGB images gathered from a host dataset
            every step, through a small network, so the copy is a large part of a step:
              resident   the data already on the device (no copy: the ceiling)
              plain      `x[idx].to(device)` from pageable memory, what most hand loops do
              torch-pin  torch's DataLoader(pin_memory=True) and `.to(device, non_blocking=True)`
              towerflow  `strategy.distribute_loader(dataset, batch_size)`: pinned, copied on a side stream one batch ahead
            and how much of the copy towerflow hides: (plain - towerflow) / (plain - resident), in time per step.

    PYTHONPATH=src python3 benchmarks/gpu_train.py [--parts sync prefetch] [--rounds 7] [--json out.json]
    PYTHONPATH=src python benchmarks/gpu_train.py --device cpu --batch 16 --rounds 2 --chunk 2   # a smoke run without a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleave(runs: dict, rounds: int, chunk: int, samples_per_step: int, device: torch.device) -> dict:
    """samples/s of each variant per round; `runs[name](k)` runs k steps."""
    names = list(runs)
    rates = {v: [] for v in names}
    for r in range(rounds):
        for v in names[r % len(names):] + names[:r % len(names)]:
            _sync(device)
            start = time.perf_counter()
            runs[v](chunk)
            _sync(device)
            rates[v].append(chunk * samples_per_step / (time.perf_counter() - start))
        print(f"  round {r}: " + ", ".join(f"{v} {rates[v][-1]:,.0f}" for v in names), flush=True)
    return rates


def summarize(title: str, rates: dict) -> dict:
    base = next(iter(rates))
    print(f"\n{title}\n{'variant':<12} {'samples/s':>11} {'x ' + base:>12}   rounds")
    out = {}
    for v, rs in rates.items():
        ratio = statistics.median(a / b for a, b in zip(rs, rates[base]))
        out[v] = {"samples_per_sec": statistics.median(rs), f"x_{base}": ratio, "rounds": rs}
        print(f"{v:<12} {statistics.median(rs):>11,.0f} {ratio:>12.3f}   " + " ".join(f"{x:,.0f}" for x in rs))
    return out


# ---------------------------------------------------------------- sync: towerflow's step against the plain loop and DDP
def _plain_loop(model, opt, data, dtype, device, scaler):
    state = {"at": 0}

    def run(k):
        for _ in range(k):
            x, y = data[state["at"] % len(data)]
            state["at"] += 1
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()

    return run


def bench_sync(args, device: torch.device) -> dict:
    import towerflow
    from cifar10_towers import cifar10_inference

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(args.batch, 3, 32, 32, generator=g).to(device),
             torch.randint(0, 10, (args.batch,), generator=g).to(device)) for _ in range(8)]
    if not dist.is_initialized():  # DDP's group of one (the towerflow variant does not use it)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    results = {}
    for precision in args.precisions:
        dtype = DTYPES[precision]
        fp16 = precision == "fp16" and device.type == "cuda"

        def fresh():
            torch.manual_seed(0)
            model = cifar10_inference().to(device)
            return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        model, opt = fresh()
        plain = _plain_loop(model, opt, data, dtype, device, torch.amp.GradScaler("cuda") if fp16 else None)
        strategy = towerflow.OneDeviceStrategy(device=args.device_name, mixed_precision=None if precision == "fp32" else precision)
        tf_model, tf_opt = strategy.setup(*fresh())
        state = {"at": 0}

        def towerflow_run(k, strategy=strategy, tf_model=tf_model, tf_opt=tf_opt):
            for _ in range(k):
                towerflow.train_step(strategy, tf_model, tf_opt, data[state["at"] % len(data)], F.cross_entropy)
                state["at"] += 1

        ddp_model, ddp_opt = fresh()
        ddp_model = nn.parallel.DistributedDataParallel(ddp_model, device_ids=[device] if device.type == "cuda" else None)
        ddp = _plain_loop(ddp_model, ddp_opt, data, dtype, device, torch.amp.GradScaler("cuda") if fp16 else None)
        runs = {"plain": plain, "towerflow": towerflow_run, "ddp": ddp}
        for run in runs.values():
            run(args.warmup)
        print(f"sync, {precision}:", flush=True)
        rates = interleave(runs, args.rounds, args.chunk, args.batch, device)
        results[precision] = summarize(f"sync {precision}: CIFAR-10 network, batch {args.batch}, {device}", rates)
    return results


# ---------------------------------------------------------------- prefetch: the copy hidden behind compute
def _small_net(channels: int = 32) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, channels, 7, stride=4, padding=3), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(channels * 16, 10))


def bench_prefetch(args, device: torch.device) -> dict:
    import towerflow

    n = args.batch * 8
    g = torch.Generator().manual_seed(0)
    host = TensorDataset(torch.randn(n, 3, args.image, args.image, generator=g), torch.randint(0, 10, (n,), generator=g))
    resident = [t.to(device) for t in host.tensors]
    strategy = towerflow.OneDeviceStrategy(device=args.device_name)

    def loop(batches_of):
        torch.manual_seed(0)
        model = _small_net().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        it = {"batches": iter(())}

        def run(k):
            for _ in range(k):
                batch = next(it["batches"], None)
                if batch is None:
                    it["batches"] = iter(batches_of())
                    batch = next(it["batches"])
                x, y = batch
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()

        return run

    def order():
        return torch.randperm(n, generator=torch.Generator().manual_seed(1)).split(args.batch)

    def on_device():
        return ((resident[0][i.to(device)], resident[1][i.to(device)]) for i in order())

    def pageable():
        return ((host.tensors[0][i].to(device), host.tensors[1][i].to(device)) for i in order())

    def torch_pinned():
        loader = DataLoader(host, batch_size=args.batch, shuffle=True, pin_memory=device.type == "cuda",
                            generator=torch.Generator().manual_seed(1))
        return ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in loader)

    def towerflow_loader():
        return strategy.distribute_loader(host, batch_size=args.batch, shuffle=True)

    runs = {"plain": loop(pageable), "resident": loop(on_device), "torch-pin": loop(torch_pinned),
            "towerflow": loop(towerflow_loader)}
    for run in runs.values():
        run(args.warmup)
    mb = host.tensors[0][:args.batch].numel() * 4 / 2**20
    print(f"prefetch: batches of {args.batch} x 3x{args.image}x{args.image} ({mb:.0f} MB a step):", flush=True)
    rates = interleave(runs, args.rounds, args.chunk, args.batch, device)
    out = summarize(f"prefetch: {mb:.0f} MB a step, {device}", rates)
    per_step = {v: args.batch / out[v]["samples_per_sec"] for v in out}
    copy = per_step["plain"] - per_step["resident"]
    hidden = (per_step["plain"] - per_step["towerflow"]) / copy if copy > 0 else float("nan")
    print(f"copy time per step {1000 * copy:.2f} ms; towerflow hides {hidden:.0%} of it")
    out["copy_hidden_fraction"] = hidden
    out["batch_mb"] = mb
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", default=["sync", "prefetch"], choices=["sync", "prefetch"])
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "fp16"], choices=sorted(DTYPES))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--image", type=int, default=128, help="prefetch: image side (the copy's size)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--chunk", type=int, default=50, help="steps per timed chunk")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # DDP's device_ids wants an index
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here. Run on a GPU machine, or --device cpu for a smoke run")
    args.device_name = f"/gpu:{device.index}" if device.type == "cuda" else "/cpu:0"
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "no GPU"
    print(f"torch {torch.__version__}, {gpu}, {os.cpu_count()} CPUs", flush=True)
    results = {"torch": torch.__version__, "gpu": gpu}
    if "sync" in args.parts:
        results["sync"] = bench_sync(args, device)
    if "prefetch" in args.parts:
        results["prefetch"] = bench_prefetch(args, device)
    if dist.is_initialized():
        dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
