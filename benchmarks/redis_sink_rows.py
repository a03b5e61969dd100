"""How fast the Redis sink writes rows, and what it costs the ps task's process (docs/benchmarks.md).

    PYTHONPATH=src python benchmarks/redis_sink_rows.py --rows 1000000 --repeats 3

Starts a redis-server of its own on a free loopback port (in memory only; stopped at the end), then, for each
variant in its own process, writes ROWS rows of DIM float32 through `RedisSink.write` into an emptied database
REPEATS times (as a first snapshot does: every key new). Reported per variant, medians over the repeats: rows/s,
the client process's CPU seconds per million rows (what the ps task pays) and the server's. Variants:

    per-row     the MSET arguments built one Python step per row (the sink's former `_pairs`)
    numpy       the keys and values built by numpy for a batch at once (the sink's `_pairs`)
    hiredis     whether redis-py packs commands with hiredis's C `pack_command` (or its own Python packer)
    batch=N     rows per MSET
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = [  # (pairs, hiredis, batch rows)
    ("per-row", False, 4096),
    ("per-row", True, 4096),
    ("numpy", False, 4096),
    ("numpy", True, 4096),
    ("numpy", True, 16384),
    ("numpy", True, 65536),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pairs_per_row(prefix, ids, values, version):
    """The sink's former MSET arguments: a key string and a value's bytes made per row in Python."""
    import numpy as np
    import torch

    n = ids.numel()
    vectors = values.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False)
    packed = np.empty((n, 8 + vectors.shape[1] * 4), dtype=np.uint8)
    packed[:, :8] = np.full(n, version, dtype="<i8").view(np.uint8).reshape(n, 8)
    packed[:, 8:] = vectors.view(np.uint8).reshape(n, -1)
    prefix = prefix.decode()
    out: list = [None] * (2 * n)
    out[0::2] = [f"{prefix}{i}" for i in ids.tolist()]
    out[1::2] = [row.tobytes() for row in packed]
    return out


def child(args) -> None:
    """One variant: REPEATS timed writes of ROWS rows, printed as one JSON line."""
    if not args.hiredis:
        sys.modules["hiredis"] = None  # redis-py then packs commands in Python
    import redis
    import torch

    from towerflow.ps.server import redis_sink
    from towerflow.ps.tables import row_files

    if args.pairs == "per-row":
        redis_sink._pairs = _pairs_per_row
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(args.rows, dtype=torch.int64) * 2  # a mod table's shard 0 of 2
    values = torch.randn(args.rows, args.dim, generator=g)
    url = f"redis://127.0.0.1:{args.port}/0"
    out = {"pairs": args.pairs, "hiredis": bool(redis.utils.HIREDIS_AVAILABLE), "batch_rows": args.batch,
           "rows_per_s": [], "client_cpu_s_per_m": [], "server_cpu_s_per_m": []}
    for _ in range(args.repeats):
        redis.Redis(host="127.0.0.1", port=args.port).flushdb()
        sink = redis_sink.RedisSink(url, "bench", 0, batch_rows=args.batch)
        chunks = row_files.chunked(ids, values, row_files.CHUNK_ROWS)
        server0, cpu0, wall0 = _cpu_seconds(args.server_pid), time.process_time(), time.perf_counter()
        sink.write("snapshot", 1, time.time(), [("emb", args.dim, chunks)], {})
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        server = _cpu_seconds(args.server_pid) - server0
        out["rows_per_s"].append(args.rows / wall)
        out["client_cpu_s_per_m"].append(cpu * 1e6 / args.rows)
        out["server_cpu_s_per_m"].append(server * 1e6 / args.rows)
    print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma-separated variant numbers (0-based) to run")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", default="numpy", help=argparse.SUPPRESS)
    parser.add_argument("--hiredis", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=4096, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", dest="server_pid", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed (tools/install_schedulers.sh installs it)")
    port = _free_port()
    scratch = tempfile.mkdtemp(prefix="redis-sink-bench-")
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                               "--dir", scratch], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              start_new_session=True)
    results = []
    try:
        time.sleep(0.5)
        picked = VARIANTS if args.only is None else [VARIANTS[int(i)] for i in args.only.split(",")]
        print(f"{args.rows:,} rows x {args.dim} float32, {args.repeats} repeats each, medians")
        print(f"{'pairs':8} {'hiredis':8} {'batch':>6} {'rows/s':>10} {'client cpu s/M':>15} {'server cpu s/M':>15}")
        for pairs, hiredis, batch in picked:
            run = subprocess.run([sys.executable, __file__, "--child", "--pairs", pairs, "--hiredis", str(int(hiredis)),
                                  "--batch", str(batch), "--port", str(port), "--server-pid", str(server.pid),
                                  "--rows", str(args.rows), "--dim", str(args.dim), "--repeats", str(args.repeats)],
                                 capture_output=True, text=True, timeout=900)
            if run.returncode:
                sys.exit(f"variant {pairs}/{hiredis}/{batch} failed:\n{run.stderr}")
            got = json.loads(run.stdout.strip().splitlines()[-1])
            results.append(got)
            print(f"{pairs:8} {str(got['hiredis']):8} {batch:>6} {statistics.median(got['rows_per_s']):>10,.0f} "
                  f"{statistics.median(got['client_cpu_s_per_m']):>15.2f} "
                  f"{statistics.median(got['server_cpu_s_per_m']):>15.2f}", flush=True)
    finally:
        server.kill()
        server.wait(10)
        shutil.rmtree(scratch, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": args.rows, "dim": args.dim, "repeats": args.repeats, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
