"""Exports RUN to OUT and prints the process's peak anonymous memory growth in bytes (argv: RUN OUT).

The growth is RssAnon (/proc/self/status) sampled every 2 ms while the export runs, less its value just before:
what the process holds itself, not the checkpoint's or the table's file pages the kernel maps in and can drop."""

import sys
import threading

import pyarrow.parquet  # noqa: F401 (imported before the baseline, as the export imports it)
import torch  # noqa: F401

from towerflow.export import export_run


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


run, out = sys.argv[1], sys.argv[2]
base, peak, done = rss_anon(), [0], threading.Event()


def sample():
    while not done.wait(0.002):
        peak[0] = max(peak[0], rss_anon())


sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
info = export_run(run, out)
done.set()
sampler.join()
peak[0] = max(peak[0], rss_anon())
print(f"growth {peak[0] - base} rows {sum(t['rows'] for t in info.tables.values())}")
