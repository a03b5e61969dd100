"""Linear regression on a parameter server and two workers (seed 002, example 4).

    towerflow launch --ps 1 --workers 2 examples/linear_regression_ps.py

or by hand, one line per terminal (the seeds' flags; start them in any order):

    python examples/linear_regression_ps.py --ps_hosts localhost:2222 --worker_hosts localhost:2223,localhost:2224 --job_name ps --task_index 0
    python examples/linear_regression_ps.py --ps_hosts localhost:2222 --worker_hosts localhost:2223,localhost:2224 --job_name worker --task_index 0
    python examples/linear_regression_ps.py --ps_hosts localhost:2222 --worker_hosts localhost:2223,localhost:2224 --job_name worker --task_index 1

The ps holds w and b (starting at -1 and -2, as in the seed); both workers fit
y = 2x + 0.2 + noise one sample at a time with Adagrad(0.8), which runs on the ps. Each
worker prints its partial result after every pass over the data; the chief prints the fit.
"""

import argparse
import os

import torch
from torch import nn

import towerflow


class Line(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(-1.0))
        self.b = nn.Parameter(torch.tensor(-2.0))

    def forward(self, x):
        return x * self.w + self.b


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], parents=[towerflow.cluster_flags()],
                                allow_abbrev=False)
    p.add_argument("--epochs", type=int, default=20, help="passes over the 101 samples, per worker")
    p.add_argument("--steps", type=int, default=None, help="stop at this global step instead")
    p.add_argument("--batch-size", "--batch_size", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.8)
    p.add_argument("--mode", default=os.environ.get("TOWERFLOW_PS_MODE", "async"), choices=["async", "sync", "ssp"])
    p.add_argument("--replicas-to-aggregate", "--replicas_to_aggregate", type=int, default=None)
    p.add_argument("--staleness", type=int, default=None)
    p.add_argument("--logdir", default=os.environ.get("TOWERFLOW_LOGDIR"))
    # seed 4 draws noise whose least-squares line is within 0.01 of the true one, so the check measures training
    p.add_argument("--seed", type=int, default=4)
    return p.parse_args(argv)  # the cluster flags (--ps_hosts ...) are accepted here and read by the Server


def main(argv=None):
    args = parse_args(argv)
    server = towerflow.Server()  # from the seeds' flags or from `towerflow launch`
    if server.job_name == "ps":
        server.join()  # serve w and b until both workers are done
        return None
    strategy = towerflow.ParameterServerStrategy(
        mode=args.mode, replicas_to_aggregate=args.replicas_to_aggregate, staleness=args.staleness, server=server
    )
    g = torch.Generator().manual_seed(args.seed)  # the same data on every worker
    x = torch.linspace(-1, 1, 101)
    y = 2 * x + torch.randn(x.shape, generator=g) * 0.4 + 0.2
    x, y = x.to(strategy.device), y.to(strategy.device)  # the worker's device: a GPU where it has one

    model = Line()
    model, optimizer = strategy.setup(model, torch.optim.Adagrad(model.parameters(), lr=args.lr))
    if strategy.is_chief:
        print(strategy.layout, flush=True)
    order = torch.Generator().manual_seed(args.seed + 1 + strategy.replica_id)
    done = False
    for _ in range(args.epochs):
        perm = torch.randperm(len(x), generator=order)
        for i in range(0, len(x), args.batch_size):
            idx = perm[i:i + args.batch_size]
            optimizer.zero_grad()
            ((model(x[idx]) - y[idx]) ** 2).mean().backward()
            optimizer.step()
            if args.steps is not None and strategy.global_step >= args.steps:
                done = True
                break
        print(f"Partial result from node: {strategy.replica_id}, w: {model.w.item():.6f}, b: {model.b.item():.6f}", flush=True)
        if done:
            break
    strategy.finish()
    if strategy.is_chief:
        strategy.wait_for_workers()  # the final values: after every worker's last push
        final = strategy.variables()
        m = strategy.metrics()
        print(f"{m['steps']} steps on this worker at {m['steps_per_s']:.0f} steps/s; global step {strategy.global_step}; "
              f"staleness {m['staleness_histogram']}", flush=True)
        print(f"final: w: {final['w'].item():.4f}, b: {final['b'].item():.4f}", flush=True)
    server.join()
    return model


if __name__ == "__main__":
    main()
