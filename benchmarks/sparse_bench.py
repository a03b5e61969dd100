"""Sparse embedding tables on parameter servers against one process (docs/benchmarks.md).

    PYTHONPATH=src python benchmarks/sparse_bench.py --rows 1000000 --steps 40 --repeats 3

Variants, interleaved in each repeat, all the DLRM of examples/ctr_ps.py (26 tables x rows x 16,
batch 1024 per worker, Adam for the dense part, lazy Adam for the tables), one script
(`benchmarks/_sparse_task.py`):

* `one_process`: plain PyTorch in one process, `nn.EmbeddingBag(sparse=True)` + `torch.optim.SparseAdam`
  beside `Adam` (towerflow's OneDeviceStrategy with `sparse_optimizer=`): the one-process ceiling;
* `ps_sparse`: `towerflow launch --ps 2 --workers 2`, the tables on the ps tasks (rows only travel);
* `ps_dense` (`--dense`): the same cluster with the tables as dense variables (whole tables travel).

Reported: total samples/s (both workers summed), wire bytes per worker step against the minimum,
and the peak resident memory (VmHWM) of every process, read from /proc while it runs.
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
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TASK = os.path.join(HERE, "_sparse_task.py")


def _children(pid: int) -> List[int]:
    out = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        return out
    for k in kids:
        out += [k, *_children(k)]
    return out


def _peak_mb(pid: int):
    """(role, VmHWM in MB) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode()
        with open(f"/proc/{pid}/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return None
    role = ("ps" if "towerflow.ps.serve" in cmd else "launcher" if "towerflow launch" in cmd
            else "worker" if "_sparse_task.py" in cmd else None)
    return role, hwm / 1024


def run(argv: List[str], timeout: float) -> Dict:
    """Run one variant; its task records and the peak RSS of each of its processes, by pid."""
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "TF_CONFIG"):
        env.pop(k, None)
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: Dict[int, tuple] = {}
    done = threading.Event()

    def watch():
        while not done.is_set():
            for pid in [proc.pid, *_children(proc.pid)]:
                got = _peak_mb(pid)
                if got and got[0]:
                    peaks[pid] = max(peaks.get(pid, got), got, key=lambda x: x[1])
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
    records = [json.loads(line.split("SPARSE_BENCH ", 1)[1]) for line in out.splitlines() if "SPARSE_BENCH " in line]
    if proc.returncode != 0 or not records:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{out[-4000:]}")
    by_role: Dict[str, List[float]] = {}
    for role, mb in peaks.values():
        by_role.setdefault(role, []).append(round(mb))
    return {"samples_per_s": sum(r["samples_per_s"] for r in records),
            "wire_bytes_per_step": statistics.mean(r["wire_bytes_per_step"] for r in records),
            "wire_minimum_per_step": statistics.mean(r["wire_minimum_per_step"] for r in records),
            "peak_rss_mb": by_role, "records": records}


def variants(args) -> Dict[str, List[str]]:
    common = ["--rows", str(args.rows), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    launch = [sys.executable, "-m", "towerflow", "launch", "--ps", "2", "--workers", "2", TASK]
    out = {"one_process": [sys.executable, TASK, *common, "--threads", str(args.threads)],
           "ps_sparse": [*launch, *common]}
    if args.dense:
        out["ps_dense"] = [*launch, "--rows", str(args.rows), "--steps", str(args.dense_steps), "--warmup", "1",
                           "--dense-tables"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the one-process run (the machine's cores)")
    p.add_argument("--dense", action="store_true", help="also the dense ps path (slow: whole tables travel)")
    p.add_argument("--dense-steps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(HERE, "results", "sparse_bench.json"))
    args = p.parse_args()
    results: Dict[str, List[Dict]] = {}
    for repeat in range(args.repeats):
        for name, argv in variants(args).items():
            r = run(argv, timeout=1800)
            results.setdefault(name, []).append(r)
            print(f"repeat {repeat} {name}: {r['samples_per_s']:.0f} samples/s, wire {r['wire_bytes_per_step']:.0f} "
                  f"B/step (minimum {r['wire_minimum_per_step']:.0f}), peak RSS MB {r['peak_rss_mb']}", flush=True)
    ceiling = statistics.median(r["samples_per_s"] for r in results["one_process"])
    print(f"\nmedians over {args.repeats} repeats, {args.rows:,} rows x 26 tables x 16, batch 1024 per worker:")
    for name, runs in results.items():
        sps = statistics.median(r["samples_per_s"] for r in runs)
        wire = statistics.median(r["wire_bytes_per_step"] for r in runs)
        minimum = statistics.median(r["wire_minimum_per_step"] for r in runs)
        ratio = f"{wire / minimum:.3f}x minimum" if wire else "nothing travels"
        print(f"  {name:12s} {sps:8.0f} samples/s ({sps / ceiling:.2f} x one process)  wire {wire:,.0f} B/step ({ratio})"
              f"  peak RSS MB {runs[-1]['peak_rss_mb']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
