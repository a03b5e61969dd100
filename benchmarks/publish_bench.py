"""What publishing changed rows costs training (docs/benchmarks.md, "Publishing rows while training").

    PYTHONPATH=src python benchmarks/publish_bench.py --rows 1000000 --steps 600 --every 10 --repeats 3

`examples/ctr_ps.py` (26 tables x rows x 16, batch 1,024 per worker, Adagrad) on `towerflow launch --ps 2
--workers 2`, launched alternately without and with `--publish-every EVERY` (the order flips each repeat),
the runs one after another on the same machine. Reported per launch: the samples/s of both workers summed
(what the example prints, from its session's start to its end) and, with publishing, each ps task's
publications (kind, rows, seconds to write); then the median of each variant and their ratio. Each launch's
output goes to OUT/NAME.log, the figures to OUT/summary.json.

With `--redis`, the publications go to a redis-server the script starts on a free loopback port (in
memory only, flushed before each launch) instead of files: whether the Redis sink keeps up is each
publication's write time against the period, read from the announcement every half second while the job
runs. `--redis-nice N` starts that server at a lower priority: in production Redis serves from hosts of its
own, and on one small machine its CPU would otherwise be counted as the publisher's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "src"))

from towerflow.ps.tables import delta_log  # noqa: E402

WORKER_LINE = re.compile(r"worker (\d+): (\d+) steps in ([\d.]+)s, (\d+) samples/s")


def launch(args, publish: bool, log_path: str) -> dict:
    logdir = tempfile.mkdtemp(prefix="publish-bench-", dir=args.scratch)
    argv = [sys.executable, "-m", "towerflow", "launch", "--ps", "2", "--workers", "2", "--logdir", logdir]
    if publish:
        argv += ["--publish-every", str(args.every)]
        if args.redis_url:
            argv += ["--publish-to", args.redis_url]
            import redis

            redis.Redis.from_url(args.redis_url, socket_timeout=120).flushdb(asynchronous=True)
    argv += [os.path.join(REPO, "examples", "ctr_ps.py"), "--rows", str(args.rows), "--steps", str(args.steps),
             "--test-size", str(args.test_size)]
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src"))
    started = time.time()
    watched: dict = {}
    stop = threading.Event()
    watcher = (threading.Thread(target=_watch_redis, args=(args.redis_url, watched, stop), daemon=True)
               if publish and args.redis_url else None)
    if watcher is not None:
        watcher.start()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        rc = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    stop.set()
    if watcher is not None:
        watcher.join()
    text = open(log_path).read()
    workers = {int(m.group(1)): float(m.group(4)) for m in WORKER_LINE.finditer(text)}
    out = {"publish": publish, "rc": rc, "wall_s": round(time.time() - started, 1),
           "samples_per_s": sum(workers.values()), "workers": workers}
    if publish and args.redis_url:
        import redis

        client = redis.Redis.from_url(args.redis_url)
        out["redis"] = {"keys": client.dbsize(), "used_memory_mb": round(client.info("memory")["used_memory"] / 2 ** 20),
                        "last": {task: {k.decode(): v.decode() for k, v in client.hgetall(f"towerflow:model:ps-{task}").items()}
                                 for task in (0, 1)}}
        out["publications_seconds"] = _publish_lines(text)
        out["publications"] = {task: sorted(seen.values(), key=lambda e: e["seq"]) for task, seen in watched.items()}
    elif publish:
        root = os.path.join(logdir, "publish")
        out["publications"] = {
            task: [{"seq": e.seq, "kind": e.kind, "step": e.global_step, "rows": sum(e.rows.values()),
                    "seconds": e.seconds} for e in delta_log.read_manifest(delta_log.task_dir(root, "model", task))]
            for task in (0, 1)}
    with open(log_path, "a") as log:
        log.write("\n" + json.dumps(out) + "\n")
    shutil.rmtree(logdir, ignore_errors=True)
    return out


def _watch_redis(url: str, seen: dict, stop: threading.Event) -> None:
    """Every publication each ps task announces in Redis while the job runs: seq, kind, rows, write seconds."""
    from towerflow.serving.redis_rows import RedisRows

    rows = RedisRows(url)
    while not stop.wait(0.5):
        for task in (0, 1):
            try:
                got = rows.published(task)
            except Exception:  # the server busy past its timeout: read again next time
                continue
            if got is not None:
                seen.setdefault(task, {})[got["seq"]] = {"seq": got["seq"], "kind": got["kind"], "step": got["global_step"],
                                                         "rows": sum(got["rows"].values()), "seconds": got["seconds"]}


def _publish_lines(text: str) -> list:
    """The snapshots the ps tasks logged (Redis keeps only the last announcement)."""
    return re.findall(r"published snapshot \d+ of 'model' at global step \d+ \([^)]*\)", text)


def _start_redis(scratch: str, nice: int = 0):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([*(["nice", "-n", str(nice)] if nice else []), "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", scratch], stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT, start_new_session=True)
    time.sleep(1.0)
    return server, f"redis://127.0.0.1:{port}/0"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--test-size", type=int, default=20_000)
    p.add_argument("--every", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--scratch", default=tempfile.gettempdir(), help="where the runs' logdirs go (removed after each)")
    p.add_argument("--redis", action="store_true", help="publish to a redis-server started here instead of files")
    p.add_argument("--redis-nice", type=int, default=0, help="start that redis-server at this niceness")
    p.add_argument("--out", default=os.path.join(HERE, "results", f"publish_{time.strftime('%Y-%m-%d')}"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    redis_server, args.redis_url = _start_redis(args.scratch, args.redis_nice) if args.redis else (None, None)
    runs = []
    try:
        for r in range(args.repeats):
            for publish in ((False, True) if r % 2 == 0 else (True, False)):
                name = f"run{r}_{'publish' if publish else 'off'}"
                result = launch(args, publish, os.path.join(args.out, f"{name}.log"))
                runs.append({"name": name, **result})
                print(f"{name}: rc {result['rc']}, {result['samples_per_s']:.0f} samples/s, {result['wall_s']} s", flush=True)
    finally:  # the server goes with the script, also when a launch fails
        if redis_server is not None:
            redis_server.kill()
    off = [r["samples_per_s"] for r in runs if not r["publish"] and r["rc"] == 0]
    on = [r["samples_per_s"] for r in runs if r["publish"] and r["rc"] == 0]
    summary = {"args": vars(args), "machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())}, "runs": runs,
               "median_off": statistics.median(off) if off else None, "median_publish": statistics.median(on) if on else None}
    if off and on:
        summary["ratio"] = round(summary["median_publish"] / summary["median_off"], 3)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"median samples/s without publishing {summary['median_off']}, publishing every {args.every:g} s "
          f"{summary['median_publish']}: {summary.get('ratio')}x")


if __name__ == "__main__":
    main()
