"""towerflow's messaging layer against its floor: a bare pyzmq round trip of the same frames, and fan-in.

    PYTHONPATH=src python benchmarks/messaging.py                      # every part, 3 interleaved rounds
    PYTHONPATH=src python benchmarks/messaging.py --parts roundtrip --rounds 5 --json out.json

* roundtrip: one ps step's shape (push a float32 tensor of S bytes, receive one of S bytes back), two
  processes on loopback, one torch thread each, S = 4 KB, 340 KB, 4 MB. `bare`: a pyzmq DEALER in the
  calling thread and a ROUTER echo in the server's main thread, [header, payload] frames sent without
  a copy. `towerflow`: `messaging.Endpoint.call(...).wait()` of a deferred function that answers with
  a tensor it holds (authenticated, as on loopback by default: any thread's call, through the socket
  thread); `towerflow_direct`: the same call on a `DirectChannel` (what a ps worker's steps use: sent
  and read by the calling thread); `towerflow_direct_curve`: that, encrypted (the default across
  hosts). Contenders rotate within each round; round trips/s, medians over rounds.
* fanin: 8 client processes each making small calls (a 4 KB tensor each way) as fast as they can to
  one server process; total calls/s the server answered. `bare` (the pyzmq DEALER/ROUTER pair above: the
  ceiling on this machine), `towerflow` (`Endpoint.call`), `towerflow_direct` (a `DirectChannel` per
  client, a ps worker's path), `towerflow_direct_quick` (that, calling a function marked `quick`: run
  on the server's socket thread, as the ps's row reads and pushes are) and `rpc` (torch.distributed.rpc on TensorPipe, what towerflow used
  before), in turn within each round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

SIZES = {"4KB": 4096, "340KB": 340_000, "4MB": 4 << 20}
SECONDS = 2.0
CLIENTS = 8


def _held(nbytes: int) -> torch.Tensor:
    return torch.ones(max(nbytes // 4, 1))


_REPLIES = {}


def _answer(grad: torch.Tensor) -> "torch.futures.Future":
    """The ps step's shape: take a gradient, answer with values of the same size it already holds."""
    fut = torch.futures.Future()
    values = _REPLIES.get(grad.numel())
    if values is None:
        values = _REPLIES[grad.numel()] = torch.ones(grad.numel())
    fut.set_result(values)
    return fut


def _small(x: torch.Tensor) -> torch.Tensor:
    return _held(4096)


# ---- the two sides of each contender, as subprocesses of this file


def _small_quick(x: torch.Tensor) -> torch.Tensor:
    return _held(4096)


def _serve_bare(port_file: str) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    _write(port_file, f"tcp://127.0.0.1:{port}")
    replies = {}
    while True:
        frames = s.recv_multipart(copy=False)
        if frames[1].bytes == b"stop":
            return
        n = len(frames[2].buffer)
        reply = replies.get(n)
        if reply is None:
            reply = replies[n] = memoryview(_held(n).numpy()).cast("B")
        s.send_multipart([frames[0], b"r", reply], copy=False)


def _serve_towerflow(port_file: str, mode: str) -> None:
    from towerflow.cluster.calls import messaging
    from towerflow.cluster.calls.wire_security import WireSecurity

    messaging.deferred(_answer)
    messaging.quick(_small_quick)
    endpoint = messaging.Endpoint("server", "127.0.0.1", WireSecurity(mode, "bench"), lambda name: None, 30.0)
    _write(port_file, endpoint.address)
    while not os.path.exists(port_file + ".stop"):
        time.sleep(0.05)
    endpoint.close()


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _wait_for(path: str) -> str:
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server never wrote {path}")
        time.sleep(0.02)
    return open(path).read()


def _rate(once, seconds: float = SECONDS, barrier=None) -> float:
    """Calls of `once()` per second over `seconds`, after 20 to warm up (and `barrier()`, when given)."""
    for _ in range(20):
        once()
    if barrier is not None:
        barrier()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        once()
        n += 1
    return n / (time.perf_counter() - start)


def _bare_client(address: str, nbytes: int) -> float:
    import zmq

    ctx = zmq.Context()
    c = ctx.socket(zmq.DEALER)
    c.connect(address)
    payload = memoryview(_held(nbytes).numpy()).cast("B")

    def once():
        c.send_multipart([b"h", payload], copy=False)
        frames = c.recv_multipart(copy=False)
        torch.frombuffer(frames[1].buffer, dtype=torch.float32)

    rate = _rate(once)
    c.close(0)
    ctx.term()
    return rate


def _towerflow_client(address: str, nbytes: int, mode: str, direct: bool, fn=_answer) -> float:
    from towerflow.cluster.calls import messaging
    from towerflow.cluster.calls.wire_security import WireSecurity

    endpoint = messaging.Endpoint(f"client{os.getpid()}", "127.0.0.1", WireSecurity(mode, "bench"),
                                  lambda name: address, 30.0)
    grad = _held(nbytes)
    if direct:  # what a ps worker's steps use: a connection its training thread owns
        channel = endpoint.direct("server")
        rate = _rate(lambda: channel.call(fn, grad).result())
        channel.close()
    else:
        rate = _rate(lambda: endpoint.call("server", fn, (grad,)).wait())
    endpoint.close()
    return rate


def _python(*args: str, **env: str) -> subprocess.Popen:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen([sys.executable, __file__, *args], env=full)


def roundtrip(rounds: int, tmp: str) -> dict:
    contenders = ("bare", "towerflow", "towerflow_direct", "towerflow_direct_curve")
    rates = {c: {s: [] for s in SIZES} for c in contenders}
    for r in range(rounds):
        for c in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
            port_file = os.path.join(tmp, f"rt-{c}-{r}")
            server = _python("--serve", c, "--port-file", port_file)
            address = _wait_for(port_file)
            for name, nbytes in SIZES.items():
                out = subprocess.run([sys.executable, __file__, "--client", c, "--address", address, "--bytes",
                                      str(nbytes)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                     capture_output=True, text=True, timeout=120, check=True)
                rates[c][name].append(float(out.stdout.strip().splitlines()[-1]))
            _stop(c, server, address, port_file)
    med = {c: {s: statistics.median(v) for s, v in by.items()} for c, by in rates.items()}
    for name in SIZES:
        print(f"roundtrip {name:>6}: " + "  ".join(f"{c} {med[c][name]:7.0f}/s (bare/it {med['bare'][name] / med[c][name]:.2f})"
                                                    for c in contenders), flush=True)
    return {"rates": rates, "medians": med}


def _stop(contender: str, server: subprocess.Popen, address: str, port_file: str) -> None:
    if contender == "bare":
        import zmq

        ctx = zmq.Context()
        c = ctx.socket(zmq.DEALER)
        c.connect(address)
        c.send_multipart([b"stop", b""])
        c.close(1000)
        ctx.term()
    else:
        _write(port_file + ".stop", "")
    server.wait(30)


def _barrier(gate: str):
    """Every fan-in client starts timing together, once all are connected and warm: a client still
    importing must not slow the others' timed window."""
    def wait():
        _write(f"{gate}.ready.{os.getpid()}", "")
        _wait_for(f"{gate}.go")
    return wait


def _fanin_client(contender: str, address: str, seconds: float, gate: str) -> float:
    if contender == "bare":
        import zmq

        ctx = zmq.Context()
        c = ctx.socket(zmq.DEALER)
        c.connect(address)
        payload = memoryview(_held(4096).numpy()).cast("B")

        def once():
            c.send_multipart([b"h", payload], copy=False)
            torch.frombuffer(c.recv_multipart(copy=False)[1].buffer, dtype=torch.float32)

        n = _rate(once, seconds, _barrier(gate))
        c.close(0)
        ctx.term()
        return n
    if contender.startswith("towerflow"):
        from towerflow.cluster.calls import messaging
        from towerflow.cluster.calls.wire_security import WireSecurity

        endpoint = messaging.Endpoint(f"client{os.getpid()}", "127.0.0.1", WireSecurity("authenticate", "bench"),
                                      lambda name: address, 30.0)
        x = _held(4096)
        if contender.startswith("towerflow_direct"):
            fn = _small_quick if contender.endswith("quick") else _small
            channel = endpoint.direct("server")
            n = _rate(lambda: channel.call(fn, x).result(), seconds, _barrier(gate))
            channel.close()
        else:
            n = _rate(lambda: endpoint.call("server", _small, (x,)).wait(), seconds, _barrier(gate))
        endpoint.close()
        return n
    raise ValueError(contender)


def _rpc_fanin(rank: int, world: int, port: int, seconds: float, out: str) -> None:
    from torch.distributed import rpc

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120,
                                           _transports=["uv"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    if rank > 0:
        x = _held(4096)
        rate = _rate(lambda: rpc.rpc_sync("w0", _small, args=(x,)), seconds)
        _write(f"{out}.{rank}", str(rate))
    rpc.shutdown()


def _open_gate(gate: str, clients: list) -> None:
    deadline = time.monotonic() + 120
    while len([f for f in os.listdir(os.path.dirname(gate)) if f.startswith(os.path.basename(gate) + ".ready.")]) < CLIENTS:
        if time.monotonic() > deadline or any(p.poll() is not None for p in clients):
            raise RuntimeError("a fan-in client never got ready")
        time.sleep(0.02)
    _write(gate + ".go", "")


def fanin(rounds: int, tmp: str) -> dict:
    contenders = ("bare", "towerflow", "towerflow_direct", "towerflow_direct_quick", "rpc")
    totals = {c: [] for c in contenders}
    for r in range(rounds):
        for c in contenders[r % len(contenders):] + contenders[:r % len(contenders)]:
            if c != "rpc":
                port_file = os.path.join(tmp, f"fan-{c}-{r}")
                server = _python("--serve", "bare" if c == "bare" else "towerflow", "--port-file", port_file)
                address = _wait_for(port_file)
                clients = [subprocess.Popen([sys.executable, __file__, "--fanin-client", c, "--address", address,
                                             "--port-file", port_file], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                            stdout=subprocess.PIPE, text=True) for _ in range(CLIENTS)]
                _open_gate(port_file, clients)
                total = sum(float(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in clients)
                _stop(c, server, address, port_file)
            else:
                import socket

                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                out = os.path.join(tmp, f"rpc-{r}")
                procs = [_python("--rpc-rank", str(k), "--port", str(port), "--out", out) for k in range(CLIENTS + 1)]
                for p in procs:
                    p.wait(180)
                total = sum(float(open(f"{out}.{k}").read()) for k in range(1, CLIENTS + 1))
            totals[c].append(total)
            print(f"fanin round {r} {c}: {total:.0f} calls/s", flush=True)
    med = {c: statistics.median(v) for c, v in totals.items()}
    print(f"fanin ({CLIENTS} clients, 4 KB each way), calls/s: " + ", ".join(f"{c} {med[c]:.0f}" for c in contenders)
          + f"; towerflow_direct_quick / rpc {med['towerflow_direct_quick'] / med['rpc']:.2f}, "
          f"bare / rpc {med['bare'] / med['rpc']:.2f}",
          flush=True)
    return {"totals": totals, "medians": med}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="roundtrip,fanin")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--port-file", help=argparse.SUPPRESS)
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--fanin-client", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--rpc-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.serve == "bare":
        return _serve_bare(a.port_file)
    if a.serve:
        return _serve_towerflow(a.port_file, "encrypt" if a.serve.endswith("curve") else "authenticate")
    if a.client == "bare":
        return print(_bare_client(a.address, a.bytes))
    if a.client:
        return print(_towerflow_client(a.address, a.bytes, "encrypt" if a.client.endswith("curve") else "authenticate",
                                       direct="direct" in a.client))
    if a.fanin_client:
        return print(_fanin_client(a.fanin_client, a.address, SECONDS * 2, a.port_file))
    if a.rpc_rank is not None:
        return _rpc_fanin(a.rpc_rank, CLIENTS + 1, a.port, SECONDS * 2, a.out)
    import tempfile

    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "rounds": a.rounds}
    with tempfile.TemporaryDirectory() as tmp:
        for part in a.parts.split(","):
            result[part] = {"roundtrip": roundtrip, "fanin": fanin}[part](a.rounds, tmp)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
