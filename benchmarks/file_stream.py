"""Training from files against training from the same records in memory, and the file pipeline alone.

    PYTHONPATH=src python benchmarks/file_stream.py [--rounds 3] [--json out.json]

Writes the synthetic click log twice: in Criteo's layout as TSV (26 hex categoricals, 13 counts; 100,000
rows per table, 8 files of 40,000 records) and as a warehouse export in Parquet with named columns (a text
id, integer ids, two list columns; `write_named_ctr_files`, 10 tables of 10,000 rows, 8 files of 40,000).
Then, in interleaved rounds, for each layout:
* pipeline: one process reads a worker's share (worker 0 of 2) through `FileStream` as fast as it can,
  batches of 1,024, shuffle window 16,384: samples/s, and the peak RSS growth over the run;
* training: `towerflow launch --ps 1 --workers 2 examples/ctr_ps.py --data DIR` for 300 global steps from
  the files, and the same with `--in-memory` (the training files read whole first, then shuffled batches
  from memory): both workers' samples/s.
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
NAMED_ROWS, NAMED_TABLES = 10_000, 10
LAYOUTS = {  # how each layout is read: the stream's arguments, and the example's flags
    "criteo_tsv": (f"rows_per_table=[{ROWS}] * 26", ["--rows", str(ROWS)]),
    "named_parquet": (f"schema=Schema.infer(PATH, label='clk', rows={NAMED_ROWS})",
                      ["--label", "clk", "--rows", str(NAMED_ROWS)]),
}


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERFLOW_", "TF_CONFIG", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")])
    return env


def _write(layout: str, folder: str) -> None:
    if layout == "criteo_tsv":
        subprocess.run([sys.executable, "-m", "towerflow.data.write_ctr", folder, "--format", "criteo", "--rows",
                        str(ROWS), "--files", str(FILES), "--records-per-file", str(RECORDS), "--test-size", "20000"],
                       env=_env(), check=True, capture_output=True, timeout=600)
        return
    code = ("from towerflow.data import synthetic_ctr\n"
            "from towerflow.data.ctr_files import write_named_ctr_files\n"
            f"data = synthetic_ctr({NAMED_ROWS}, num_tables={NAMED_TABLES}, num_dense=4, test_size=20000)\n"
            f"write_named_ctr_files(data, {folder!r}, files={FILES}, records_per_file={RECORDS}, lists=2)\n")
    subprocess.run([sys.executable, "-c", code], env=_env(), check=True, capture_output=True, timeout=600)


def _pipeline(folder: str, layout: str) -> dict:
    """samples/s of worker 0 of 2 reading one epoch, in a fresh process; its RSS growth."""
    code = (
        "import resource, time, sys\n"
        "from towerflow.data import FileStream, Schema\n"
        f"PATH = {folder!r}\n"
        f"s = FileStream(PATH, None, {BATCH}, worker=0, num_workers=2, shuffle_window=16384, {LAYOUTS[layout][0]})\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "n, t0 = 0, time.perf_counter()\n"
        "for batch in s:\n"
        "    if s.epoch > 0: break\n"
        "    n += len(batch) if not isinstance(batch, tuple) else len(batch[2])\n"
        "dt = time.perf_counter() - t0\n"
        "print(n, n / dt, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**_env(), "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=600, check=True)
    n, rate, grown = out.stdout.split()
    return {"records": int(n), "samples_per_s": float(rate), "rss_growth_mb": float(grown)}


def _training(folder: str, layout: str, in_memory: bool) -> float:
    argv = [sys.executable, "-m", "towerflow", "launch", "--ps", "1", "--workers", "2",
            os.path.join(ROOT, "examples", "ctr_ps.py"), "--data", folder, *LAYOUTS[layout][1], "--steps", "300"]
    if in_memory:
        argv.append("--in-memory")
    out = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=900, check=True).stdout
    return sum(float(r) for r in re.findall(r"worker \d: \d+ steps in [\d.]+s, (\d+) samples/s", out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    pipeline = {layout: [] for layout in LAYOUTS}
    training = {(layout, source): [] for layout in LAYOUTS for source in ("files", "memory")}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {layout: os.path.join(tmp, layout) for layout in LAYOUTS}
        for layout, folder in folders.items():
            t0 = time.perf_counter()
            _write(layout, folder)
            print(f"wrote {layout} in {time.perf_counter() - t0:.1f} s", flush=True)
        for r in range(a.rounds):
            for layout, folder in folders.items():
                got = _pipeline(os.path.join(folder, "train"), layout)
                pipeline[layout].append(got)
                print(f"round {r} pipeline {layout}: {got}", flush=True)
            keys = list(training)
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                rate = _training(folders[key[0]], key[0], key[1] == "memory")
                training[key].append(rate)
                print(f"round {r} training {key[0]} from {key[1]}: {rate:.0f} samples/s", flush=True)
    med_pipe = {k: statistics.median(x["samples_per_s"] for x in v) for k, v in pipeline.items()}
    max_rss = {k: max(x["rss_growth_mb"] for x in v) for k, v in pipeline.items()}
    med_train = {k: statistics.median(v) for k, v in training.items()}
    summary = {layout: {"pipeline_samples_per_s": round(med_pipe[layout]),
                        "training_from_files": round(med_train[(layout, "files")]),
                        "training_from_memory": round(med_train[(layout, "memory")]),
                        "pipeline_over_consumption_per_worker": round(
                            med_pipe[layout] / (med_train[(layout, "files")] / 2), 2),
                        "files_over_memory": round(med_train[(layout, "files")] / med_train[(layout, "memory")], 3),
                        "peak_rss_growth_mb": max_rss[layout]} for layout in LAYOUTS}
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": f"{os.cpu_count()} cores", "pipeline": pipeline,
                       "training": {f"{k[0]}/{k[1]}": v for k, v in training.items()}, "summary": summary}, f,
                      indent=1)


if __name__ == "__main__":
    main()
