"""towerflow's synchronous strategy against a hand-written DistributedDataParallel loop.

Same model (examples/mnist_sync.py's CNN), same data, same global batch, same process count,
same processes and process group: each launch (torchrun) runs both, alternating in chunks of
steps, so a shared machine's noise hits both alike. Reported: samples/s per variant (median
over chunks), the towerflow / DDP ratio (median of the paired, adjacent-in-time chunk ratios),
and scaling from 1 to N processes.

    .venv/bin/python benchmarks/sync_vs_ddp.py [--procs 1 2] [--launches 3] [--rounds 10] [--chunk 20] [--data PATH]
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


def _launch(procs: int, args) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", WORKERS,
           "--rounds", str(args.rounds), "--chunk", str(args.chunk), "--warmup", str(args.warmup),
           "--batch-size", str(args.batch_size)]
    if args.data:
        cmd += ["--data", args.data]
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(HERE), "src")}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"x{procs} failed (rc={done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


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
    p.add_argument("--launches", type=int, default=3, help="torchrun launches per process count (interleaved)")
    p.add_argument("--rounds", type=int, default=10, help="chunk pairs per launch")
    p.add_argument("--chunk", type=int, default=20, help="steps per timed chunk")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=128, help="global batch size")
    p.add_argument("--data", default=None, help="MNIST t10k folder; synthetic MNIST-shaped data when left out")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (default 1: N processes use N cores; 0 leaves torch's default)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="also write the raw numbers here")
    args = p.parse_args(argv)

    print(f"machine: {_machine()}", flush=True)
    rates = {n: {"ddp": [], "towerflow": []} for n in args.procs}
    threads = {}
    for launch in range(args.launches):
        for n in args.procs:
            out = _launch(n, args)
            threads[n] = out["threads"]
            for v in ("ddp", "towerflow"):
                rates[n][v] += out["samples_per_sec"][v]
            last = out["samples_per_sec"]
            print(f"launch {launch + 1}/{args.launches} x{n}: ddp {statistics.median(last['ddp']):.0f}, "
                  f"towerflow {statistics.median(last['towerflow']):.0f} samples/s (chunk medians)", flush=True)

    print(f"\nglobal batch {args.batch_size}; {args.launches} launches x {args.rounds} chunk pairs of {args.chunk} steps "
          f"per process count, after {args.warmup} warm-up steps each:")
    print("| processes (torch threads each) | DDP samples/s | towerflow samples/s | towerflow / DDP |")
    print("| --- | --- | --- | --- |")
    med = {}
    for n in args.procs:
        d, t = statistics.median(rates[n]["ddp"]), statistics.median(rates[n]["towerflow"])
        paired = statistics.median(b / a for a, b in zip(rates[n]["ddp"], rates[n]["towerflow"]))
        med[n] = (d, t)
        print(f"| {n} ({threads[n]}) | {d:.0f} | {t:.0f} | {paired:.3f} |")
    if len(args.procs) > 1:
        lo, hi = min(args.procs), max(args.procs)
        print(f"\nscaling {lo} -> {hi} processes: DDP {med[hi][0] / med[lo][0]:.2f}x, "
              f"towerflow {med[hi][1] / med[lo][1]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": _machine(), "args": vars(args), "threads": threads,
                       "samples_per_sec": {str(n): r for n, r in rates.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
