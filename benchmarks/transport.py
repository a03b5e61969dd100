"""Measure the transports towerflow could use for remote calls, on this machine, in one run.

    .venv/bin/python benchmarks/transport.py [--repeats 20] [--append docs/benchmarks.md]

Compares, between two processes on loopback:
  * torch.distributed.rpc (TensorPipe): round-trip latency of a small call, and push/pull
    throughput of 4 MB and 64 MB float32 tensors;
  * c10d send/recv over gloo: the same push/pull throughput;
  * rpc with TensorPipe's default transports (it picks "shm" between local processes) and
    restricted to its TCP transport ("uv": towerflow's default, and what crosses hosts);
    tensor payloads between local processes go by CMA (process_vm_readv) either way;
  * the CPU an idle rpc member burns (TensorPipe's shm reactor busy-polls, chosen or not);
  * a raw TCP socket (sendall / recv_into): the throughput ceiling.
Buffers are allocated once and reused (a fresh 64 MB allocation costs ~50 ms here, which
would swamp the transfer). Reports medians and the ratio of each to the socket ceiling.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_MB = (4, 64)
SMALL_CALLS = 300

# Buffers held by the receiving process, reused across calls.
_BUFFERS = {}


def _noop(x):
    return x


def _take(t):  # rpc push: the server receives the tensor and drops it
    return None


def _give(mb):  # rpc pull: the server hands back a tensor it already holds
    return _BUFFERS[mb]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, repeats):
    fn()  # warm up connections and allocators
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _rpc(rank, port, repeats, queue, transports=None):
    import torch.distributed.rpc as rpc

    for mb in SIZES_MB:
        _BUFFERS[mb] = torch.ones(mb * 2**18)
    # `_transports` only counts in the constructor (an attribute set afterwards is ignored)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120, _transports=transports)
    label = f"rpc ({'+'.join(transports)} transport)" if transports else "rpc (default transports: shm)"
    rpc.init_rpc(f"t{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        res = {}
        before = time.process_time()
        time.sleep(2.0)
        res[f"{label} idle process CPU"] = ("cpu", (time.process_time() - before) / 2.0)
        small = torch.ones(4)
        lat = []
        for _ in range(SMALL_CALLS):
            t = time.perf_counter()
            rpc.rpc_sync("t1", _noop, args=(small,))
            lat.append(time.perf_counter() - t)
        res[f"{label} small call round trip"] = ("latency", statistics.median(lat[20:]))
        for mb in SIZES_MB:
            buf = _BUFFERS[mb]
            res[f"{label} push {mb} MB"] = ("bytes", mb, _timed(lambda: rpc.rpc_sync("t1", _take, args=(buf,)), repeats))
            res[f"{label} pull {mb} MB"] = ("bytes", mb, _timed(lambda: rpc.rpc_sync("t1", _give, args=(mb,)), repeats))
        queue.put(res)
    rpc.shutdown()


def _gloo(rank, port, repeats, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for mb in SIZES_MB:
        buf = torch.ones(mb * 2**18)
        ack = torch.zeros(1)
        for direction, sender in (("push", 0), ("pull", 1)):
            def once():
                if rank == sender:
                    dist.send(buf, 1 - rank)
                    dist.recv(ack, 1 - rank)  # so the sender's clock covers delivery
                else:
                    dist.recv(buf, 1 - rank)
                    dist.send(ack, 1 - rank)

            dt = _timed(once, repeats)
            if rank == 0:
                res[f"c10d gloo send/recv {direction} {mb} MB"] = ("bytes", mb, dt)
    if rank == 0:
        queue.put(res)
    dist.destroy_process_group()


def _socket(rank, port, repeats, queue):
    chunk = 1 << 20
    if rank == 1:
        srv = socket.create_server(("127.0.0.1", port))
        conn, _ = srv.accept()
        view = memoryview(bytearray(max(SIZES_MB) << 20))
        while True:
            head = conn.recv(8)
            if not head:
                break
            n = int.from_bytes(head, "little")
            got = 0
            while got < n:
                got += conn.recv_into(view[got : min(n, got + chunk)])
            conn.sendall(b"k")
        conn.close()
        srv.close()
        return
    deadline = time.time() + 30
    while True:
        try:
            conn = socket.create_connection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    res = {}
    for mb in SIZES_MB:
        data = memoryview(torch.ones(mb * 2**18).numpy().view("uint8"))

        def once():
            conn.sendall(len(data).to_bytes(8, "little"))
            conn.sendall(data)
            conn.recv(1)

        res[f"raw TCP socket {mb} MB (ceiling)"] = ("bytes", mb, _timed(once, repeats))
    conn.close()
    queue.put(res)


def _rpc_tcp(rank, port, repeats, queue):
    _rpc(rank, port, repeats, queue, transports=["uv"])


def _run(fn, repeats):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=fn, args=(r, port, repeats, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        if p.exitcode != 0:
            for q in procs:
                q.kill()
            raise SystemExit(f"{fn.__name__} benchmark process failed with exit code {p.exitcode}")
    return queue.get()


def _machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:10]
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return "\n".join(
        [f"nproc: {nproc}", f"python {platform.python_version()}, torch {torch.__version__}", "lscpu | head:", *lscpu]
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20, help="timed transfers per size (median reported)")
    parser.add_argument("--append", metavar="FILE", help="append the results as a '## Transport' section")
    args = parser.parse_args(argv)

    results = {}
    for fn in (_socket, _gloo, _rpc, _rpc_tcp):
        results.update(_run(fn, args.repeats))

    ceiling = {mb: results[f"raw TCP socket {mb} MB (ceiling)"][2] for mb in SIZES_MB}
    rows = ["| measurement | median | throughput | vs socket ceiling |", "| --- | --- | --- | --- |"]
    for name, value in results.items():
        if value[0] == "latency":
            rows.append(f"| {name} | {value[1] * 1e6:.0f} µs | | |")
        elif value[0] == "cpu":
            rows.append(f"| {name} | {value[1] * 100:.0f}% of a core | | |")
        else:
            _, mb, dt = value
            rows.append(f"| {name} | {dt * 1e3:.1f} ms | {mb / 1024 / dt:.2f} GB/s | {ceiling[mb] / dt:.2f}x |")
    table = "\n".join(rows)
    print(table)
    print(_machine())
    if args.append:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        section = (
            f"\n## Transport\n\nRun {stamp} with `.venv/bin/python benchmarks/transport.py --repeats {args.repeats}` "
            f"(two processes on loopback, medians, buffers reused; 'vs socket ceiling' is the socket's time over this "
            f"one's, 1.00x = as fast as a raw socket).\n\n{table}\n\nMachine:\n\n```\n{_machine()}\n```\n"
        )
        with open(args.append, "a") as f:
            f.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
