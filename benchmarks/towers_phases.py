"""Where one step of towers in one process goes, phase by phase, beside the plain loop.

benchmarks/towers.py gives the ratios; this gives the reasons: per step of the large MLP (the one
of towers.py), the medians over `--steps` steps of zero_grad, forward, backward and the optimizer's
update, and for towers the time of each tower's forward and `autograd.grad` (the calling thread
is tower 0, "@1" the other tower's thread) and of the whole towers backward (those, the sum of the
gradients, the hand-offs). Variants, each in its own process, in turn, `--repeat` times:

  plain-1t / plain-2t   the plain loop with torch threads 1 / 2, batch B
  plain-1t-half         the plain loop with torch threads 1 on B/2 samples (one tower's share, alone)
  towers                MirroredStrategy(devices=["/cpu:0", "/cpu:1"]): 2 towers of B/2

    PYTHONPATH=src python benchmarks/towers_phases.py [--steps 10] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("plain-1t", "plain-2t", "plain-1t-half", "towers")


def _timed(name: str, fn, seen: dict):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            own = "" if threading.current_thread() is threading.main_thread() else "@1"
            seen.setdefault(name + own, []).append((time.perf_counter() - start) * 1000)
    return wrapper


def one_variant(variant: str, batch: int, steps: int) -> dict:
    """Runs in its own process: the phase medians (ms) of `steps` steps after 4 of warm-up."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, HERE)
    from ps_bench import large_mlp

    import towerflow
    from towerflow.strategies import towers as towers_mod

    seen: dict = {}
    towers_mod._Call.run = _timed("tower forward", towers_mod._Call.run, seen)
    towers_mod._Call.grads = _timed("tower grads", towers_mod._Call.grads, seen)
    backward = towers_mod._TowersFunction.backward
    towers_mod._TowersFunction.backward = staticmethod(_timed("towers backward", backward, seen))
    torch.manual_seed(0)
    model = large_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    strategy = None
    if variant == "towers":
        strategy = towerflow.MirroredStrategy(devices=["/cpu:0", "/cpu:1"])
        model, opt = strategy.setup(model, opt)
    torch.set_num_threads(2 if variant == "plain-2t" else 1)
    n = batch // 2 if variant == "plain-1t-half" else batch
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    phases: dict = {"zero_grad": [], "forward": [], "backward": [], "update": []}
    for step in range(4 + steps):
        if step == 4:
            seen.clear()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if step >= 4:
            for name, ms in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                phases[name].append(ms * 1000)
    if strategy is not None:
        strategy.shutdown()
    out = {name: statistics.median(v) for name, v in phases.items()}
    out["step"] = sum(out.values())
    out.update({name: statistics.median(v) for name, v in seen.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_variant(args.one, args.batch, args.steps)))
        return
    # OMP_NUM_THREADS set would make the towers leave every thread count alone (towerflow's rule): unset here
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for r in range(args.repeat):
        for variant in VARIANTS:
            done = subprocess.run([sys.executable, __file__, "--one", variant, "--steps", str(args.steps),
                                   "--batch", str(args.batch)], env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                sys.exit(f"{variant} failed:\n{done.stderr[-3000:]}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"round {r} {variant:14s} " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)


if __name__ == "__main__":
    main()
