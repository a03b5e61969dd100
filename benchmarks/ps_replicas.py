"""What replicated ps shards cost: `--ps-replicas 1` against `2`, side by side in one run (docs/benchmarks.md).

    PYTHONPATH=src python benchmarks/ps_replicas.py --launches 5

Two jobs, each launched with `towerflow launch --ps 2 --workers 2 --ps-replicas R` (on one host `--workers N`
gives N workers), R = 1 and 2 interleaved (1, 2, 1, 2, ...) so both see the same machine load:

* `mlp`: benchmarks/_replicas_task.py, ps_step.py's small MLP (84,490 parameters, batch 32, SGD), one
  torch thread per process (OMP_NUM_THREADS=1); total steps/s of both workers;
* `ctr`: examples/ctr_ps.py, the DLRM with 26 sparse tables on the ps tasks (`--rows` per table, batch
  1024 per worker, lazy Adam on the rows); total samples/s of both workers;
* `bare`: the `mlp` job on pyzmq alone (benchmarks/_bare_zmq_replicas.py: no towerflow, the same rule for when
  a reply may go), the least replication can cost on this machine's cores and wire; encrypted with `--hosts 3`
  unless `--wire authenticate` (then no security at all: authentication costs only at the handshake).

`--hosts 3` runs each launch on three network-namespace hosts (root; benchmarks/_replicas_hosts.py): ps 0
alone, ps 1 beside worker 0, worker 1 on the third, so that every mirror is on another host (the wire's
default across hosts: encrypted; `--wire authenticate` for authentication alone). `--settings 1,2,2@64` adds a setting with asynchronous replication (`--ps-replica-lag 64`); the settings
rotate from launch to launch. Prints each launch's rate, the medians and each setting's ratio to the
first, with the load average before and after, and writes the raw numbers to
benchmarks/results/ps_replicas.json (atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def _setting(text: str) -> tuple:
    """'R' or 'R@LAG': --ps-replicas R, and --ps-replica-lag LAG when given."""
    replicas, _, lag = text.partition("@")
    return int(replicas), (int(lag) if lag else None)


def _command(job: str, setting: str, args) -> tuple:
    """(the launch's flags for this setting, the script and its arguments)."""
    replicas, lag = _setting(setting)
    flags = ["--ps-replicas", str(replicas)] + (["--ps-replica-lag", str(lag)] if lag is not None else [])
    if job == "mlp":
        return flags, [os.path.join(HERE, "_replicas_task.py"), str(args.mlp_steps), str(args.mlp_hidden)]
    return flags, [os.path.join(REPO, "examples", "ctr_ps.py"), "--rows", str(args.rows), "--steps", str(args.ctr_steps),
                   "--test-size", "2000"]


def _rate(job: str, output: str, workers: int = 2) -> float:
    """Total steps/s (mlp) or samples/s (ctr) of every worker, from their lines."""
    pattern = r"steps/s ([0-9.]+)" if job == "mlp" else r"steps in [0-9.]+s, ([0-9.]+) samples/s"
    rates = [float(r) for r in re.findall(pattern, output)]
    if len(rates) != workers:
        raise RuntimeError(f"expected {workers} workers' rates in the {job} job's output, found {rates}:\n"
                           f"{output[-4000:]}")
    return sum(rates)


def run(job: str, setting: str, args) -> float:
    if job == "bare":
        from _bare_zmq_replicas import run as run_bare

        replicas, lag = _setting(setting)
        if lag is not None:
            raise SystemExit(f"--jobs bare --settings {setting}: the bare job has no asynchronous replication; "
                             "give 1 and 2 only")
        curve = args.hosts == 3 and args.wire != "authenticate"
        return _rate("mlp", run_bare(replicas, args.mlp_steps, args.hosts, curve, args.timeout))
    path = os.pathsep.join(filter(None, [os.path.join(REPO, "src"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)  # keeps a site folder the caller gives
    if job == "mlp":
        env["OMP_NUM_THREADS"] = "1"
    flags, script = _command(job, setting, args)
    if args.hosts == 3:
        from _replicas_hosts import run_on_hosts

        wire = {"TOWERFLOW_WIRE_SECURITY": args.wire} if args.wire else {}
        return _rate(job, run_on_hosts(script, flags, wire, args.timeout))  # one torch thread per task there
    launch = [sys.executable, "-m", "towerflow", "launch", "--ps", "2", "--workers", str(args.workers), *flags, *script]
    done = subprocess.run(launch, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{job} setting {setting} exited {done.returncode}:\n{done.stdout[-4000:]}"
                           f"{done.stderr[-4000:]}")
    return _rate(job, done.stdout + done.stderr, args.workers)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=5, help="launches of each job and setting, interleaved")
    p.add_argument("--jobs", default="mlp,ctr")
    p.add_argument("--mlp-steps", type=int, default=2000)
    p.add_argument("--mlp-hidden", type=int, default=256, help="mlp: the hidden layers' width (256: 84,490 parameters)")
    p.add_argument("--ctr-steps", type=int, default=150)
    p.add_argument("--rows", type=int, default=200_000, help="ctr: rows per table")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--workers", type=int, default=2, help="one host: the workers of each job (1: one link per ps)")
    p.add_argument("--settings", default="1,2", help="comma-separated R or R@LAG (--ps-replicas R --ps-replica-lag LAG)")
    p.add_argument("--hosts", type=int, default=1, choices=(1, 3),
                   help="3: on three network-namespace hosts (root), each part's mirror on another host")
    p.add_argument("--wire", choices=("encrypt", "authenticate"), default=None,
                   help="with --hosts 3: TOWERFLOW_WIRE_SECURITY for every task (default: encrypt, as across hosts)")
    p.add_argument("--out", default=os.path.join(RESULTS, "ps_replicas.json"))
    args = p.parse_args(argv)
    if args.workers < 1 or (args.workers != 2 and (args.hosts != 1 or "bare" in args.jobs.split(","))):
        p.error(f"--workers {args.workers}: expected 1 or more, and 2 with --hosts 3 or --jobs bare")
    settings = args.settings.split(",")
    for setting in settings:
        _setting(setting)  # a bad one fails before any launch
    results = {"hosts": args.hosts, "wire": args.wire, "loadavg_before": os.getloadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "python": sys.version.split()[0], "runs": {}}
    for job in args.jobs.split(","):
        rates = {s: [] for s in settings}
        for launch in range(args.launches):
            k = launch % len(settings)
            for setting in settings[k:] + settings[:k]:
                rate = run(job, setting, args)
                rates[setting].append(rate)
                print(f"{job} setting {setting}: {rate:.1f} (load {os.getloadavg()[0]:.2f})", flush=True)
        medians = {s: statistics.median(v) for s, v in rates.items()}
        base = settings[0]
        # each launch round's own ratio (the same minutes of this machine), then their median: steadier than the
        # ratio of the medians when the machine's speed drifts during the run
        paired = {s: statistics.median(r / b for r, b in zip(rates[s], rates[base])) for s in settings}
        results["runs"][job] = {"rates": rates, "median": medians,
                                "ratio": {s: medians[s] / medians[base] for s in settings}, "paired_ratio": paired}
        print(f"{job}: medians " + ", ".join(f"{s}: {medians[s]:.1f} ({100 * (1 - medians[s] / medians[base]):.1f}% "
                                              f"fewer than {base}; paired {100 * (1 - paired[s]):.1f}%)"
                                              for s in settings), flush=True)
    results["loadavg_after"] = os.getloadavg()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, args.out)
    return results


if __name__ == "__main__":
    main()
