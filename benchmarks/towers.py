"""Towers in one process against the one-process loop and against two DDP replica processes.

For each model, side by side in one run, interleaved round by round (the order rotates every
round, so a shared machine's noise hits every variant alike):

  plain-1t  the plain PyTorch loop in one process, batch B, torch threads = 1
  plain-2t  the same with torch threads = 2 (this machine's cores)
  towers    MirroredStrategy(devices=["/cpu:0", "/cpu:1"]) in this process: 2 towers (the calling
            thread and one more) of B/2 each, 1 torch thread per tower (the default on 2 cores),
            gradients summed in memory; the optimizer step runs in the calling thread (1 thread)
  towers-2t the same with threads_per_tower=2 (oversubscribed: the thread-count choice)
  ddp       MirroredStrategy() in two replica processes (`towerflow launch --nproc 2`), B/2 each,
            DDP over gloo, 1 torch thread per replica (benchmarks/_towers_ddp.py)

Reported per variant: samples/s (median over rounds), the median of the per-round ratios to
plain-1t and to plain-2t, and CPU milliseconds per sample (all threads; both processes for ddp):
the work a variant spends, which a shared machine's load changes far less than the wall clock. Models: `large` (784-4096-3328-10, 16.9M parameters, synthetic
MNIST-shaped data; benchmarks/ps_bench.py's `large_mlp`) and `small` (64-256-256-10 on the 8x8 digits).

Two ways to compare, as scaling is measured: by default the one batch B is split between the towers
(the same global batch: strong scaling); with --per-tower-batch each tower and each ddp replica takes a
whole batch B (global 2B) while the one-process loops keep B, as TensorFlow's towers are fed (one
batch per tower, the global batch = per-replica batch x replicas: weak scaling).

    PYTHONPATH=src python benchmarks/towers.py [--models large small] [--rounds 7] [--per-tower-batch] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# model: (batch size, steps per timed chunk)
DEFAULTS = {"large": (256, 3), "small": (32, 200)}


def build(name: str) -> nn.Module:
    if name == "large":
        from ps_bench import large_mlp

        return large_mlp()
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def batches(name: str, batch_size: int):
    if name == "large":
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(batch_size, 1, 28, 28, generator=g), torch.randint(0, 10, (batch_size,), generator=g))
                for _ in range(8)]
    from towerflow.data import load_mnist_or_digits

    x, y = load_mnist_or_digits(None).train.tensors
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return [(x[order[i:i + batch_size]], y[order[i:i + batch_size]])
            for i in range(0, len(x) - batch_size + 1, batch_size)]


def _one_process(name, data, threads, strategy=None):
    torch.manual_seed(0)
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if strategy is not None:
        model, opt = strategy.setup(model, opt)
    state = {"at": 0}

    def run(k):
        torch.set_num_threads(threads)  # this thread's count (the towers' threads keep theirs)
        for _ in range(k):
            x, y = data[state["at"] % len(data)]
            state["at"] += 1
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

    return run


def _launch_ddp(name, batch_size, warmup, timeout):
    from towerflow.cluster.ports import PortReservation

    port = PortReservation(1).ports[0]  # released at once: the store below binds it next
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=timeout))
    cmd = [sys.executable, "-m", "towerflow", "launch", "--nproc", "2", os.path.join(HERE, "_towers_ddp.py"),
           "--store", f"127.0.0.1:{port}", "--model", name, "--batch-size", str(batch_size), "--warmup", str(warmup)]
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(HERE), "src")}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    store.wait(["ready/0", "ready/1"])
    threads = int(store.get("ready/0"))
    rnd = {"n": 0}

    def run(k):
        n = rnd["n"]
        store.set(f"go/{n}", str(k))
        rate = float(store.get(f"done/{n}"))
        cpu = float(store.get(f"cpu/{n}/0")) + float(store.get(f"cpu/{n}/1"))
        rnd["n"] += 1
        return rate, cpu

    def stop():
        store.set(f"go/{rnd['n']}", "0")
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise SystemExit(f"the DDP replicas failed (rc={proc.returncode}):\n{out[-4000:]}")

    return run, stop, threads


def bench(name: str, args) -> dict:
    import towerflow

    batch_size, chunk = DEFAULTS[name]
    batch_size = args.batch_size or batch_size
    chunk = args.chunk or chunk
    # the batch each variant's step takes: B everywhere, or with --per-tower-batch B per tower (2B for the
    # towers and the ddp pair, B for the one-process loops: TensorFlow's towers, each fed its own batch)
    per_step = {v: batch_size for v in ("plain-1t", "plain-2t", "towers", "towers-2t", "ddp")}
    if args.per_tower_batch:
        per_step.update({"towers": 2 * batch_size, "towers-2t": 2 * batch_size, "ddp": 2 * batch_size})
    data = {b: batches(name, b) for b in set(per_step.values())}
    towers = towerflow.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
    towers_2t = towerflow.MirroredStrategy(devices=["/cpu:0", "/cpu:1"], threads_per_tower=2)
    runs = {
        "plain-1t": _one_process(name, data[per_step["plain-1t"]], 1),
        "plain-2t": _one_process(name, data[per_step["plain-2t"]], 2),
        "towers": _one_process(name, data[per_step["towers"]], 1, towers),
        "towers-2t": _one_process(name, data[per_step["towers-2t"]], 2, towers_2t),
    }
    for run in runs.values():
        run(args.warmup)
    ddp_run, ddp_stop, ddp_threads = _launch_ddp(name, per_step["ddp"], args.warmup, args.timeout)
    names = [*runs, "ddp"]
    rates = {v: [] for v in names}
    cpu_ms = {v: [] for v in names}  # CPU milliseconds (all threads, both processes for ddp) per sample
    try:
        for r in range(args.rounds):
            for v in names[r % len(names):] + names[:r % len(names)]:
                if v == "ddp":
                    rate, cpu = ddp_run(chunk)
                else:
                    start, cpu0 = time.perf_counter(), time.process_time()
                    runs[v](chunk)
                    rate, cpu = chunk * per_step[v] / (time.perf_counter() - start), time.process_time() - cpu0
                rates[v].append(rate)
                cpu_ms[v].append(1000 * cpu / (chunk * per_step[v]))
            print(f"  {name} round {r}: " + ", ".join(f"{v} {rates[v][-1]:,.0f}" for v in names), flush=True)
    finally:
        ddp_stop()
        towers.shutdown()
        towers_2t.shutdown()
    return {"batch_size": batch_size, "batch_per_step": per_step, "chunk_steps": chunk, "ddp_threads_per_replica": ddp_threads,
            "parameters": sum(p.numel() for p in build(name).parameters()), "samples_per_sec": rates,
            "cpu_ms_per_sample": cpu_ms}


def summarize(name: str, result: dict) -> None:
    rates = result["samples_per_sec"]
    batch = result["batch_per_step"]
    print(f"\n{name}: {result['parameters']:,} parameters, batch per step "
          + ", ".join(f"{v} {b}" for v, b in batch.items()) + ", "
          f"{len(rates['plain-1t'])} rounds of {result['chunk_steps']} steps per variant")
    print(f"{'variant':<10} {'samples/s':>10} {'x plain-1t':>11} {'x plain-2t':>11} {'CPU ms/sample':>14}   rounds")
    for v, rs in rates.items():
        r1 = statistics.median(a / b for a, b in zip(rs, rates["plain-1t"]))
        r2 = statistics.median(a / b for a, b in zip(rs, rates["plain-2t"]))
        cpu = statistics.median(result["cpu_ms_per_sample"][v])
        print(f"{v:<10} {statistics.median(rs):>10,.0f} {r1:>11.2f} {r2:>11.2f} {cpu:>14.3f}   "
              + " ".join(f"{x:,.0f}" for x in rs))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["large", "small"], choices=sorted(DEFAULTS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--chunk", type=int, default=None, help="steps per timed chunk (default: 3 large, 200 small)")
    p.add_argument("--batch-size", type=int, default=None, help="default: 256 large, 32 small")
    p.add_argument("--per-tower-batch", action="store_true",
                   help="each tower (and each ddp replica) takes a whole batch, as TensorFlow's towers do; "
                        "default: the one batch is split between them")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None, help="also write the raw numbers here")
    args = p.parse_args(argv)

    from sync_vs_ddp import _machine

    print(f"machine: {_machine()}", flush=True)
    results = {name: bench(name, args) for name in args.models}
    for name, result in results.items():
        summarize(name, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
