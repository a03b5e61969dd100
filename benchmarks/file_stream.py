"""Training from files against training from memory, and the file pipeline alone.

    PYTHONPATH=src python benchmarks/file_stream.py [--rounds 3] [--json out.json]

Writes the synthetic click log (100,000 rows per table, 8 files of 40,000 records) as Parquet and as
Criteo TSV, then, in interleaved rounds:
* pipeline: one process reads a worker's share (worker 0 of 2) through `FileStream` as fast as it can,
  batches of 1,024, shuffle window 16,384: samples/s, and the peak RSS growth over the run;
* training: `towerflow launch --ps 1 --workers 2 examples/ctr_ps.py` for 300 global steps from memory,
  from the Parquet files and from the TSV files: the workers' samples/s.
Medians over rounds; ratios in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ROWS, FILES, RECORDS, BATCH = 100_000, 8, 40_000, 1024


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERFLOW_", "TF_CONFIG", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    return env


def _pipeline(folder: str, fmt: str) -> dict:
    """samples/s of worker 0 of 2 reading one epoch, in a fresh process; its RSS growth."""
    code = (
        "import resource, time, sys\n"
        "from towerflow.data import FileStream\n"
        f"s = FileStream({folder!r}, {fmt!r}, {BATCH}, [{ROWS}] * 26, worker=0, num_workers=2, shuffle_window=16384)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "n, t0 = 0, time.perf_counter()\n"
        "for dense, cats, labels in s:\n"
        "    if s.epoch > 0: break\n"
        "    n += len(labels)\n"
        "dt = time.perf_counter() - t0\n"
        "print(n, n / dt, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**_env(), "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=600, check=True)
    n, rate, grown = out.stdout.split()
    return {"records": int(n), "samples_per_s": float(rate), "rss_growth_mb": float(grown)}


def _training(data: str) -> float:
    argv = [sys.executable, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2",
            os.path.join(ROOT, "examples", "ctr_ps.py"), "--rows", str(ROWS), "--steps", "300", "--test-size", "20000"]
    if data:
        argv += ["--data", data]
    out = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=900, check=True).stdout
    return sum(float(r) for r in re.findall(r"worker \d: \d+ steps in [\d.]+s, (\d+) samples/s", out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for fmt in ("parquet", "criteo"):
            folders[fmt] = os.path.join(tmp, fmt)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "towerflow.data.write_ctr", folders[fmt], "--format", fmt, "--rows",
                            str(ROWS), "--files", str(FILES), "--records-per-file", str(RECORDS), "--test-size", "20000"],
                           env=_env(), check=True, capture_output=True, timeout=600)
            print(f"wrote {fmt} in {time.perf_counter() - t0:.1f} s", flush=True)
        pipeline = {f: [] for f in folders}
        training = {c: [] for c in ("memory", "parquet", "criteo")}
        for r in range(a.rounds):
            for fmt in folders:
                got = _pipeline(os.path.join(folders[fmt], "train"), fmt)
                pipeline[fmt].append(got)
                print(f"round {r} pipeline {fmt}: {got}", flush=True)
            order = list(training)[r % 3:] + list(training)[:r % 3]
            for c in order:
                rate = _training(folders.get(c))
                training[c].append(rate)
                print(f"round {r} training {c}: {rate:.0f} samples/s", flush=True)
    med_pipe = {f: statistics.median(x["samples_per_s"] for x in v) for f, v in pipeline.items()}
    med_rss = {f: max(x["rss_growth_mb"] for x in v) for f, v in pipeline.items()}
    med_train = {c: statistics.median(v) for c, v in training.items()}
    print("pipeline samples/s (one worker's share):", {f: round(v) for f, v in med_pipe.items()},
          "peak RSS growth MB:", med_rss)
    print("training samples/s (both workers):", {c: round(v) for c, v in med_train.items()})
    print("pipeline / training consumption per worker:",
          {f: round(med_pipe[f] / (med_train[f] / 2), 2) for f in med_pipe},
          "files / memory:", {f: round(med_train[f] / med_train["memory"], 2) for f in med_pipe})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": f"{os.cpu_count()} cores", "pipeline": pipeline, "training": training,
                       "medians": {"pipeline": med_pipe, "training": med_train, "rss_growth_mb": med_rss}}, f, indent=1)


if __name__ == "__main__":
    main()
