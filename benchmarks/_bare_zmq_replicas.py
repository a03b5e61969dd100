"""benchmarks/ps_replicas.py's `bare` job: what replicating a ps part costs at the least, on pyzmq alone.

The `mlp` job's setup (ps_step.py's small MLP, batch 32, SGD lr 0.05, 2 ps + 2 workers, one torch thread each)
with no towerflow: each ps holds half of the values; a worker sends each half of its flat gradient to its ps as
one zero-copy frame and installs the halves sent back. With 2 replicas each ps forwards every gradient it applies
to the other ps, which applies it to its mirror and acknowledges it, and a reply to a worker's push waits until
the backup holds that worker's previous push: the rule towerflow's replication keeps. No framing, no recovery, no
authentication; every process has the allocator settings `towerflow launch` gives a ps cluster; `--curve` encrypts every connection (CurveZMQ, as towerflow does across hosts by default). Each
worker prints `worker W: steps/s R` over its steps after the first 100, as benchmarks/_replicas_task.py does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP = 100
KEYS = "BARE_ZMQ_CURVE_SECRET"  # the runner's key pair (one for every task, as towerflow derives one from the token)


def _secure(sock, server: bool) -> None:
    import zmq

    secret = os.environ.get(KEYS)
    if not secret:
        return
    public = zmq.curve_public(secret.encode())
    if server:
        sock.curve_server = True
        sock.curve_secretkey = secret.encode()
    else:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = public, public, secret.encode()


def _halves(n: int) -> tuple:
    return (0, n // 2), (n // 2, n)


def serve(index: int, bind: str, backup: str) -> None:
    """ps `index`: its half of the values; with `backup`, every applied gradient goes on to the other ps."""
    import torch
    import zmq
    from torch.nn.utils import parameters_to_vector

    from ps_step import LR, mlp

    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    torch.manual_seed(0)
    start, stop = _halves(sum(p.numel() for p in mlp().parameters()))[index]
    torch.manual_seed(0)
    values = parameters_to_vector(mlp().parameters()).detach()[start:stop].clone()
    mirror = None  # the other ps's half, once it forwards
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    _secure(front, server=True)
    front.bind(bind)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    to_backup = None
    if backup:
        to_backup = ctx.socket(zmq.DEALER)
        _secure(to_backup, server=False)
        to_backup.connect(backup)
        poller.register(to_backup, zmq.POLLIN)
    sent = acked = 0  # ops numbered as forwarded; the backup holds every op up to `acked`
    previous = {}  # worker identity -> the number of its previous push
    held = []  # (number the reply waits for, identity, reply)
    while True:
        for sock, _ in poller.poll():
            if sock is to_backup:
                acked = int.from_bytes(to_backup.recv(), "little")
                ready = [h for h in held if h[0] <= acked]
                held = [h for h in held if h[0] > acked]
                for _, who, reply in ready:
                    front.send_multipart([who, memoryview(reply.numpy())], copy=False)
                continue
            who, kind, *rest = front.recv_multipart(copy=False)
            kind = kind.bytes
            if kind == b"m":  # the other ps's op, for its mirror
                number, grad = rest
                grad = torch.frombuffer(grad.buffer, dtype=torch.float32)
                if mirror is None:
                    mirror = torch.zeros_like(grad)
                mirror.sub_(grad, alpha=LR)
                front.send_multipart([who, number])
                continue
            if kind == b"g":
                values.sub_(torch.frombuffer(rest[0].buffer, dtype=torch.float32), alpha=LR)
            reply = values.clone()  # the values change with the next push: the reply is a copy, as it must be
            if to_backup is None or kind != b"g":
                front.send_multipart([who, memoryview(reply.numpy())], copy=False)
                continue
            sent += 1
            to_backup.send_multipart([b"m", sent.to_bytes(8, "little"), rest[0]], copy=False)
            wait_for = previous.get(who.bytes, 0)
            previous[who.bytes] = sent
            if wait_for <= acked:
                front.send_multipart([who, memoryview(reply.numpy())], copy=False)
            else:
                held.append((wait_for, who, reply))


def train(worker: int, addresses: list, steps: int) -> None:
    """A worker: pull both halves, then per step compute, push each half of the gradient, install the replies."""
    import torch
    import zmq
    from torch import nn
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from ps_step import mlp
    from towerflow.data import load_mnist_or_digits

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    ctx = zmq.Context()
    socks = []
    for address in addresses:
        s = ctx.socket(zmq.DEALER)
        _secure(s, server=False)
        s.connect(address)
        socks.append(s)
    torch.manual_seed(0)
    model = mlp()
    params = list(model.parameters())
    halves = _halves(sum(p.numel() for p in params))
    values = torch.empty(halves[1][1])
    x, y = load_mnist_or_digits(None).train.tensors
    g = torch.Generator().manual_seed(worker)
    loss_fn = nn.CrossEntropyLoss()

    def exchange(frames) -> None:
        for s, frame in zip(socks, frames):
            s.send_multipart(frame, copy=False)
        for s, (a, b) in zip(socks, halves):
            values[a:b] = torch.frombuffer(s.recv(copy=False).buffer, dtype=torch.float32)
        with torch.no_grad():
            vector_to_parameters(values, params)

    exchange([[b"p"], [b"p"]])
    for i in range(steps + WARMUP):
        if i == WARMUP:
            start = time.perf_counter()
        idx = torch.randint(0, len(y), (32,), generator=g)
        model.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        grad = parameters_to_vector([p.grad for p in params]).numpy()
        exchange([[b"g", memoryview(grad[a:b])] for a, b in halves])
    print(f"worker {worker}: steps/s {steps / (time.perf_counter() - start):.1f}", flush=True)


def run(replicas: int, steps: int, hosts: int, curve: bool, timeout: float) -> str:
    """Both workers' output lines, once they ended with 0; the ps tasks are then killed (they serve forever)."""
    import zmq

    from towerflow.launch.environment import PS_ALLOCATOR_ENV

    me = os.path.abspath(__file__)
    path = os.pathsep.join(filter(None, [os.path.join(os.path.dirname(HERE), "src"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, **PS_ALLOCATOR_ENV)  # keeps a site folder given
    if curve:
        env[KEYS] = zmq.curve_keypair()[1].decode()

    def argv(role: list) -> list:
        return [sys.executable, me, *role]

    if hosts == 1:
        from _bare_zmq_ps import free_ports

        ports = free_ports(2)
        binds = [f"tcp://127.0.0.1:{p}" for p in ports]
        backups = [binds[1], binds[0]] if replicas == 2 else ["", ""]
        ps = [subprocess.Popen(argv(["--serve", str(i), binds[i], "--backup", backups[i]]), env=env) for i in range(2)]
        workers = [subprocess.Popen(argv(["--train", str(w), *binds, "--steps", str(steps)]), env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for w in range(2)]
        try:
            outputs = []
            for w in workers:
                out = w.communicate(timeout=timeout)[0]
                if w.returncode != 0:
                    raise RuntimeError(f"a bare worker exited {w.returncode}:\n{out[-3000:]}")
                outputs.append(out)
            return "\n".join(outputs)
        finally:
            for p in ps + workers:
                p.kill()
                p.wait()
    import pathlib
    import tempfile

    from _replicas_hosts import PLACES, Hosts, outputs

    with tempfile.TemporaryDirectory() as work:
        net = Hosts(3, pathlib.Path(work))
        try:  # the mlp job's layout
            host_of = {task: host for host, tasks in zip(net.hosts, PLACES) for task in tasks}
            binds = [f"tcp://{host_of['ps', i].name}:{7100 + i}" for i in range(2)]
            backups = [binds[1], binds[0]] if replicas == 2 else ["", ""]
            extra = {k: env[k] for k in (KEYS, *PS_ALLOCATOR_ENV) if k in env}
            for i in range(2):
                net.start(host_of["ps", i], argv(["--serve", str(i), f"tcp://0.0.0.0:{7100 + i}", "--backup", backups[i]]),
                          f"ps{i}", extra)
            workers = [net.start(host_of["worker", w], argv(["--train", str(w), *binds, "--steps", str(steps)]),
                                 f"worker{w}", extra) for w in range(2)]
            return outputs(workers, timeout, "a bare worker")
        finally:
            net.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", nargs=2, metavar=("INDEX", "BIND"))
    p.add_argument("--backup", default="", help="with --serve: the other ps's address (2 replicas)")
    p.add_argument("--train", nargs=3, metavar=("WORKER", "PS0", "PS1"))
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args()
    sys.path.insert(0, HERE)
    if args.serve:
        serve(int(args.serve[0]), args.serve[1], args.backup)
    elif args.train:
        train(int(args.train[0]), args.train[1:], args.steps)
    else:
        p.error("give --serve INDEX BIND or --train WORKER PS0 PS1 (benchmarks/ps_replicas.py --jobs bare starts them)")


if __name__ == "__main__":
    main()
