"""The DDP side of `benchmarks/towers.py`: one of two replica processes started by `towerflow launch --nproc 2`.

MirroredStrategy() here is the process layout (DDP over gloo, one torch thread per replica). Both
replicas wait on the driver's TCPStore for `go/<round>` (a blocking read: idle while the driver
times its one-process variants), run that many steps between two barriers, and rank 0 writes the
samples/s to `done/<round>` (each its CPU seconds to `cpu/<round>/<rank>`); `go/<round>` = 0 ends the run.

    towerflow launch --nproc 2 benchmarks/_towers_ddp.py --store HOST:PORT --model large --batch-size B --warmup W
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from towers import batches, build  # noqa: E402

import towerflow  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--batch-size", type=int, required=True, help="global batch: each replica takes half")
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()

    strategy = towerflow.MirroredStrategy()
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=1800))
    torch.manual_seed(0)
    model = build(args.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, opt = strategy.setup(model, opt)
    n, r = strategy.num_replicas_in_sync, strategy.replica_id
    data = [(x[r::n], y[r::n]) for x, y in batches(args.model, args.batch_size)]

    def run(k, at=0):
        for i in range(k):
            x, y = data[(at + i) % len(data)]
            opt.zero_grad(set_to_none=True)
            strategy.backward(F.cross_entropy(model(x), y))
            opt.step()

    run(args.warmup)
    store.set(f"ready/{r}", str(torch.get_num_threads()))
    at, rnd = 0, 0
    while True:
        steps = int(store.get(f"go/{rnd}"))
        if steps == 0:
            break
        strategy.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        run(steps, at)
        strategy.barrier()
        store.set(f"cpu/{rnd}/{r}", str(time.process_time() - cpu))
        if strategy.is_chief:
            store.set(f"done/{rnd}", str(steps * args.batch_size / (time.perf_counter() - start)))
        at, rnd = at + steps, rnd + 1
    strategy.shutdown()


if __name__ == "__main__":
    main()
