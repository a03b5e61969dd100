"""towerflow's synchronous strategy against a hand-written DistributedDataParallel script.

Same model (examples/mnist_sync.py's CNN), same data, same global batch, same process count;
both started by torchrun, interleaved round after round, medians compared (shared machines are
noisy). Reports the samples/s ratio towerflow / DDP per process count, and scaling 1 -> N.

    .venv/bin/python benchmarks/sync_vs_ddp.py [--procs 1 2] [--rounds 5] [--steps 150] [--data PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "_sync_workers.py")


def _run(variant: str, procs: int, args) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", WORKERS, variant,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    if args.data:
        cmd += ["--data", args.data]
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(HERE), "src")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{variant} x{procs} failed (rc={done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])["samples_per_sec"]


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} CPU cores ({cpu}), {gpu}, torch {torch.__version__}, Python {platform.python_version()}, "
            f"load average {load:.1f} at start")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=128, help="global batch size")
    p.add_argument("--data", default=None, help="MNIST t10k folder; synthetic MNIST-shaped data when left out")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", default=None, help="also write the raw numbers here")
    args = p.parse_args(argv)

    print(f"machine: {_machine()}", flush=True)
    samples = {(v, n): [] for n in args.procs for v in ("ddp", "towerflow")}
    for r in range(args.rounds):
        for n in args.procs:
            order = ("ddp", "towerflow") if r % 2 == 0 else ("towerflow", "ddp")  # neither always goes first
            for v in order:
                samples[(v, n)].append(_run(v, n, args))
                print(f"round {r + 1}/{args.rounds}  {v:9s} x{n}: {samples[(v, n)][-1]:8.0f} samples/s", flush=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    best = {k: max(v) for k, v in samples.items()}  # least disturbed by other jobs on a shared machine
    print(f"\nglobal batch {args.batch_size}, {args.steps} timed steps after {args.warmup} warm-up, "
          f"{args.rounds} rounds, medians:")
    print("| processes | DDP samples/s | towerflow samples/s | towerflow / DDP (median) | towerflow / DDP (best) |")
    print("| --- | --- | --- | --- | --- |")
    for n in args.procs:
        d, t = med[("ddp", n)], med[("towerflow", n)]
        print(f"| {n} | {d:.0f} | {t:.0f} | {t / d:.3f} | {best[('towerflow', n)] / best[('ddp', n)]:.3f} |")
    if len(args.procs) > 1:
        lo, hi = min(args.procs), max(args.procs)
        print(f"\nscaling {lo} -> {hi} processes: DDP {med[('ddp', hi)] / med[('ddp', lo)]:.2f}x, "
              f"towerflow {med[('towerflow', hi)] / med[('towerflow', lo)]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": _machine(), "args": vars(args),
                       "samples_per_sec": {f"{v}x{n}": s for (v, n), s in samples.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
