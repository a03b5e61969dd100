"""Hybrid training (`--dense allreduce`) against ps-only on the CTR example (docs/benchmarks.md, "Hybrid").

    PYTHONPATH=src python benchmarks/hybrid_bench.py --repeats 5                       # the example's default DLRM
    PYTHONPATH=src python benchmarks/hybrid_bench.py --repeats 3 --top 4096,2048 --batch-size 256 --steps 40
    PYTHONPATH=src python benchmarks/hybrid_bench.py --hosts ...     # across network-namespace hosts (root)

Two variants of one launch line, interleaved in each repeat, both `towerflow launch --ps 2 --workers 2
examples/ctr_ps.py` (Adagrad; the tables' mode `--mode`, async by default):

* `ps`: every parameter on the ps tasks (the dense part pushed and pulled every step);
* `hybrid`: `--dense allreduce`, only the tables on the ps tasks, the MLPs all-reduced among the workers.

Read from the example's own lines: each worker's steps and seconds (its training loop, session included),
the bytes the chief moved to and from the ps tasks per step, and the test AUC. Reported per variant: the
median over repeats of the workers' mean steps/s, of their summed samples/s, and of the bytes per step.
A global step is one push under `ps` (async: each worker makes about half of --steps) and one all-reduced
step of every worker under `hybrid`; steps/s are each worker's own, so the two compare.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EXAMPLE = os.path.join(REPO, "examples", "ctr_ps.py")
VARIANTS = {"ps": [], "hybrid": ["--dense", "allreduce"]}


def _example_args(args) -> List[str]:
    return [EXAMPLE, "--rows", str(args.rows), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--top", args.top, "--test-size", str(args.test_size)]


def _on_one_host(variant: str, args) -> Tuple[str, str, int]:
    """The embedded cluster of one `towerflow launch`: (command, output, exit code)."""
    argv = [sys.executable, "-m", "towerflow", "launch", "--ps", str(args.ps), "--workers", str(args.workers),
            "--mode", args.mode, *VARIANTS[variant], *_example_args(args)]
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "TF_CONFIG", "TOWERFLOW_PS_DENSE"):
        env.pop(k, None)
    done = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=args.timeout)
    return " ".join(argv[1:]), done.stdout, done.returncode


def _on_namespace_hosts(variant: str, args) -> Tuple[str, str, int]:
    """The ps tasks on one network-namespace host and each worker on a host of its own (tests/multihost/netns.py,
    root): one `towerflow launch --cluster FILE` per task, the wire's default across hosts (encrypted ZeroMQ;
    the workers' gloo all-reduce is not encrypted)."""
    sys.path.insert(0, os.path.join(REPO, "tests", "multihost"))
    from netns import Hosts

    flags = ["--mode", args.mode, *VARIANTS[variant]]
    with tempfile.TemporaryDirectory() as work:
        hosts = Hosts(1 + args.workers, pathlib.Path(work))
        try:
            cluster = {"ps": [f"{hosts[0].name}:{7100 + i}" for i in range(args.ps)],
                       "worker": [f"{hosts[1 + w].name}:7200" for w in range(args.workers)]}
            cluster_file = os.path.join(work, "cluster.json")
            with open(cluster_file, "w") as f:
                json.dump(cluster, f)
            env = {"TOWERFLOW_CLUSTER_TOKEN": "hybrid-bench"}
            procs = [hosts.launch(hosts[0], cluster_file, "ps", i, _example_args(args), env, flags)
                     for i in range(args.ps)]
            procs += [hosts.launch(hosts[1 + w], cluster_file, "worker", w, _example_args(args), env, flags)
                      for w in range(args.workers)]
            codes = [p.wait(args.timeout) for p in procs]
            out = "\n".join(f"--- {p.host.name}\n{p.output}" for p in procs)
        finally:
            hosts.close()
    command = (f"on {1 + args.workers} namespace hosts: towerflow launch --cluster FILE --job_name J --task_index I "
               f"{' '.join(flags)} {' '.join(_example_args(args))}")
    return command, out, max(codes, key=abs)


def run(variant: str, args, log) -> Dict:
    """One launch of `variant`; its figures, parsed from the example's output (which goes to `log` whole)."""
    started = time.time()
    command, out, code = (_on_namespace_hosts if args.hosts else _on_one_host)(variant, args)
    log.write(f"==== {variant} {datetime.datetime.fromtimestamp(started, datetime.timezone.utc):%H:%M:%S} UTC: "
              f"{command}\n{out}\n")
    log.flush()
    if code != 0:
        raise SystemExit(f"{variant} failed (exit {code}); its output is in the log")
    workers = [(int(s), float(t)) for s, t in re.findall(r"worker \d+: (\d+) steps in ([\d.]+)s", out)]
    moved, minimum = (int(v) for v in re.search(r"wire: (\d+) bytes/step \(minimum (\d+)\)", out).groups())
    auc = float(re.search(r"test auc: ([\d.]+)", out).group(1))
    return {
        "variant": variant,
        "steps_per_s": statistics.mean(s / t for s, t in workers),
        "samples_per_s": sum(s * args.batch_size / t for s, t in workers),
        "bytes_per_step": moved,
        "bytes_minimum": minimum,
        "auc": auc,
        "workers": workers,
    }


def main(argv: List[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ps", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mode", default="async", choices=["async", "sync", "ssp"], help="the tables' update mode (both)")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--steps", type=int, default=200, help="global steps of each launch")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--top", default="64", help="hidden widths of the top MLP (4096,2048: a dense part of ~10M)")
    p.add_argument("--test-size", type=int, default=20_000)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--hosts", action="store_true",
                   help="across network-namespace hosts (root): the ps tasks on one, each worker on its own")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="where the JSON and the raw log go")
    args = p.parse_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M")
    name = f"hybrid_{args.mode}_top{args.top.replace(',', 'x')}{'_hosts' if args.hosts else ''}_{stamp}"
    os.makedirs(args.out, exist_ok=True)
    results: List[Dict] = []
    with open(os.path.join(args.out, name + ".log"), "w") as log:
        for repeat in range(args.repeats):
            for variant in VARIANTS:
                r = run(variant, args, log)
                r["repeat"] = repeat
                results.append(r)
                print(f"repeat {repeat} {variant:>6}: {r['steps_per_s']:.2f} steps/s per worker, "
                      f"{r['samples_per_s']:,.0f} samples/s, {r['bytes_per_step']:,} bytes/step to the ps, "
                      f"auc {r['auc']:.4f}", flush=True)
    summary = {}
    for variant in VARIANTS:
        mine = [r for r in results if r["variant"] == variant]
        summary[variant] = {key: statistics.median(r[key] for r in mine)
                            for key in ("steps_per_s", "samples_per_s", "bytes_per_step", "bytes_minimum", "auc")}
    ratios = [h["steps_per_s"] / q["steps_per_s"] for h, q in zip(
        [r for r in results if r["variant"] == "hybrid"], [r for r in results if r["variant"] == "ps"])]
    summary["hybrid_over_ps_steps_per_s"] = statistics.median(ratios)
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump({"args": vars(args), "results": results, "summary": summary}, f, indent=1)
    for variant in VARIANTS:
        s = summary[variant]
        print(f"median {variant:>6}: {s['steps_per_s']:.2f} steps/s per worker, {s['samples_per_s']:,.0f} samples/s, "
              f"{s['bytes_per_step']:,.0f} bytes/step to the ps ({s['bytes_per_step'] / s['bytes_minimum']:.3f}x the "
              f"minimum), auc {s['auc']:.4f}")
    print(f"hybrid / ps steps/s per worker (median of each repeat's ratio): {summary['hybrid_over_ps_steps_per_s']:.2f}x")
    print(f"raw: {os.path.join(args.out, name)}.log / .json")


if __name__ == "__main__":
    main()
