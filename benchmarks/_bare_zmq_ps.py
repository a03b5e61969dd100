"""benchmarks/ps_step.py's ceiling contenders: the least a ZeroMQ parameter server can do for the same job.

One ps process (a ROUTER socket) and two worker processes (a DEALER each), no towerflow: a worker computes its
gradient, flattens it, sends it as one zero-copy frame and waits; the ps subtracts it (SGD, lr 0.05) and answers
with a copy of its values as one zero-copy frame, which the worker installs. No authentication, no encryption,
no framing of its own, no recovery: what a ps step across hosts costs on this machine's wire and cores before
any library does anything. Every process gets the allocator settings `towerflow launch` gives a ps cluster
(towerflow.launch.environment.PS_ALLOCATOR_ENV: libzmq's fresh buffer per message reuses the last one's memory),
so that the two differ in the ps and nothing else. zmq_bare_hosts runs it on three network-namespace hosts as ps_hosts does (ps alone,
each worker on its own host), zmq_bare_local on loopback.

    python benchmarks/ps_step.py --contenders ps_hosts_auth,zmq_bare_hosts --launches 3
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PORT = 7100


def serve(bind: str, workers: int, out: str) -> None:
    """The ps: until every worker said it is done, a pull or a gradient in, the values out."""
    import resource

    import torch
    import zmq
    from torch.nn.utils import parameters_to_vector

    from ps_step import LR, mlp

    torch.manual_seed(0)
    values = parameters_to_vector(mlp().parameters()).detach().clone()
    router = zmq.Context().socket(zmq.ROUTER)
    router.bind(bind)
    done = pushes = 0
    while done < workers:
        who, body = router.recv_multipart(copy=False)
        size = body.buffer.nbytes
        if size == 4:  # b"done"
            done += 1
            router.send_multipart([who, b""])
            continue
        if size:
            if not pushes:  # from the first push on: the imports and the start are not the step's
                start = resource.getrusage(resource.RUSAGE_SELF)
            pushes += 1
            values.sub_(torch.frombuffer(body.buffer, dtype=torch.float32), alpha=LR)
        # the values change with the next gradient: the reply travels as a copy of them, as it must
        router.send_multipart([who, memoryview(values.clone().numpy())], copy=False)
    router.close(linger=1000)
    end = resource.getrusage(resource.RUSAGE_SELF)  # warm-up pushes included: they cost as the timed ones do
    cpu = (end.ru_utime + end.ru_stime) - (start.ru_utime + start.ru_stime)
    switches = (end.ru_nvcsw + end.ru_nivcsw) - (start.ru_nvcsw + start.ru_nivcsw)
    with open(os.path.join(out, "bare-ps.json"), "w") as f:
        json.dump({"cpu_s": cpu, "switches": switches, "pushes": pushes - 1}, f)


def train(connect: str, worker: int, steps: int, warmup: int, out: str) -> None:
    """A worker: pull once, then per step compute, push the flat gradient, install the values sent back."""
    import resource

    import torch
    import zmq
    from torch import nn
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    from ps_step import batches, mlp

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    dealer = zmq.Context().socket(zmq.DEALER)
    dealer.connect(connect)
    torch.manual_seed(0)
    model = mlp()
    params = list(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    data = batches(worker)

    def install(frame) -> None:
        with torch.no_grad():
            vector_to_parameters(torch.frombuffer(frame.buffer, dtype=torch.float32), params)

    dealer.send(b"")
    install(dealer.recv(copy=False))
    timers = {"compute": 0.0, "wait_reply_and_install": 0.0}

    def one() -> None:
        x, y = next(data)
        t = time.perf_counter()
        model.zero_grad()
        loss_fn(model(x), y).backward()
        grad = parameters_to_vector([p.grad for p in params])
        t1 = time.perf_counter()
        dealer.send(memoryview(grad.numpy()), copy=False)
        install(dealer.recv(copy=False))
        timers["compute"] += t1 - t
        timers["wait_reply_and_install"] += time.perf_counter() - t1

    for _ in range(warmup):
        one()
    timers.update(compute=0.0, wait_reply_and_install=0.0)
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.time()
    for _ in range(steps):
        one()
    end = time.time()
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    dealer.send(b"done")
    dealer.recv()
    result = {"steps": steps, "start": t0, "end": end}
    if worker == 0:
        cpu = (u1.ru_utime + u1.ru_stime) - (u0.ru_utime + u0.ru_stime)
        per_step = {"wall": end - t0, **timers, "worker_cpu": cpu}
        result["per_step_us"] = {k: v / steps * 1e6 for k, v in per_step.items()}
        switches = (u1.ru_nvcsw + u1.ru_nivcsw) - (u0.ru_nvcsw + u0.ru_nivcsw)
        result["per_step_switches"] = {"worker": switches / steps}
    with open(os.path.join(out, f"bare-{worker}.json"), "w") as f:
        json.dump(result, f)
    dealer.close(linger=1000)


def free_ports(n: int) -> list:
    """n distinct free ports on loopback (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run(contender: str, args, out_dir: str, env: dict) -> dict:
    """Start the ps and two workers (on namespace hosts or loopback), wait for them, read the workers' figures."""
    from towerflow.launch.environment import PS_ALLOCATOR_ENV

    env = {**env, **PS_ALLOCATOR_ENV}
    me = os.path.abspath(__file__)
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--out", out_dir]
    if contender == "zmq_bare_local":
        port = free_ports(1)[0]
        argv = [[sys.executable, me, "--serve", f"tcp://127.0.0.1:{port}", "--out", out_dir]]
        argv += [[sys.executable, me, "--train", f"tcp://127.0.0.1:{port}", "--worker", str(w), *common] for w in range(2)]
        procs = [subprocess.Popen(a, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for a in argv]
        try:
            for p in procs:
                output = p.communicate(timeout=600)[0]
                if p.returncode != 0:
                    raise SystemExit(f"{contender} failed:\n{output[-3000:]}")
        finally:
            for p in procs:
                p.kill()
    else:
        sys.path.insert(0, os.path.join(REPO, "tests", "multihost"))
        from netns import Hosts

        with tempfile.TemporaryDirectory() as work:
            hosts = Hosts(3, pathlib.Path(work))
            try:
                extra = {"PS_STEP_MODEL": args.model, **PS_ALLOCATOR_ENV}
                procs = [hosts.start(hosts[0], [sys.executable, me, "--serve", f"tcp://0.0.0.0:{PORT}", "--out", out_dir], "ps", extra)]
                procs += [hosts.start(hosts[1 + w], [sys.executable, me, "--train", f"tcp://{hosts[0].name}:{PORT}",
                                                     "--worker", str(w), *common], f"worker{w}", extra) for w in range(2)]
                for p in procs:
                    if p.wait(600) != 0:
                        raise SystemExit(f"{contender} failed on {p.host.name}:\n{p.output[-3000:]}")
            finally:
                hosts.close()
    workers = [json.load(open(os.path.join(out_dir, f"bare-{w}.json"))) for w in range(2)]
    ps = json.load(open(os.path.join(out_dir, "bare-ps.json")))  # per two pushes: the others' "all workers" figures
    workers[0]["per_step_us"]["ps_cpu (all workers)"] = ps["cpu_s"] / ps["pushes"] * 2 * 1e6
    workers[0]["per_step_switches"]["ps (all workers)"] = ps["switches"] / ps["pushes"] * 2
    return {"workers": workers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", metavar="BIND", help="run the ps, bound to BIND (tcp://HOST:PORT)")
    p.add_argument("--train", metavar="ADDRESS", help="run a worker calling the ps at ADDRESS")
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    sys.path.insert(0, HERE)
    if args.serve:
        serve(args.serve, workers=2, out=args.out)
    elif args.train:
        train(args.train, args.worker, args.steps, args.warmup, args.out)
    else:
        p.error("give --serve BIND or --train ADDRESS (benchmarks/ps_step.py starts both)")


if __name__ == "__main__":
    main()
