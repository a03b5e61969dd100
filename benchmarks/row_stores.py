"""What one push costs a ps's row store: `read` + `apply` of a batch of ids, in µs.

FixedRows: a 1M x 16 shard, 26k unique ids. HashRows: 26k ids of a 1M-row vocabulary, all
rows present (the steady state), and with 5% of the ids new each step (admissions). The
variants run interleaved, round after round, and medians are reported. Usage:

    .venv/bin/python benchmarks/row_stores.py [--rounds 30] [--ids 26000] [--rows 1000000] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from towerflow.ps import SparseAdagrad, SparseSGD
from towerflow.ps.tables.rows import FixedRows
from towerflow.ps.tables.vocabulary import HashRows


def _fixed(rows, dim, n, spec):
    store = FixedRows(torch.randn(rows, dim), spec)
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(n, dim)

    def run():
        ids = torch.randperm(rows, generator=gen)[:n]
        t = time.perf_counter()
        store.read(ids)
        store.apply(ids, grads)
        return time.perf_counter() - t

    return run


def _hash(rows, dim, n, spec, new_fraction):
    table = HashRows(dim, spec)
    for start in range(0, rows, 100_000):
        table.read(torch.arange(start, min(rows, start + 100_000)), 0)
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(n, dim)
    fresh = [rows]
    n_new = int(n * new_fraction)

    def run():
        old = torch.randperm(rows, generator=gen)[: n - n_new]
        ids = torch.cat([old, torch.arange(fresh[0], fresh[0] + n_new)])
        fresh[0] += n_new
        t = time.perf_counter()
        table.read(ids, 1)
        table.apply(ids, grads, 1)
        return time.perf_counter() - t

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--ids", type=int, default=26_000)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    variants = {}
    for spec in (SparseSGD(0.1), SparseAdagrad(0.1)):
        name = type(spec).__name__
        variants[f"FixedRows {a.rows}x{a.dim}, {name}"] = _fixed(a.rows, a.dim, a.ids, spec)
        variants[f"HashRows {a.rows} rows, all present, {name}"] = _hash(a.rows, a.dim, a.ids, spec, 0.0)
        variants[f"HashRows {a.rows} rows, 5% new, {name}"] = _hash(a.rows, a.dim, a.ids, spec, 0.05)
    times = {k: [] for k in variants}
    for _ in range(a.rounds):
        for k, run in variants.items():
            times[k].append(run())
    print(f"read + apply of {a.ids} ids, dim {a.dim}, {a.threads} thread(s), torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}; median (min) over {a.rounds} rounds")
    for k, ts in times.items():
        print(f"  {k:48s} {statistics.median(ts) * 1e6:9.0f} µs ({min(ts) * 1e6:.0f})")


if __name__ == "__main__":
    main()
