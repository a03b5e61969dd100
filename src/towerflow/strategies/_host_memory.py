"""Towers in one process keep the memory they free for their next step (glibc malloc settings).

Why: each step every tower's backward allocates a full set of fresh gradients (68 MB per tower
for a 17M-parameter model) and frees it after the sum. glibc maps chunks that large fresh from
the kernel and unmaps them on free, so every step pays a page fault per 4 KB and the kernel's
zeroing of every page, twice over with two towers. With the mmap threshold raised and trimming
held off, freed chunks stay in malloc's heap and the next step reuses them: what TF's BFC
allocator and PyTorch's CUDA caching allocator do. The price: the process keeps its peak heap
(it does not hand freed memory back to the system).

One malloc arena for the process: glibc gives each new thread an arena of its own whose heaps
are at most 64 MB, so a tower thread's chunk over 32 MB (one layer's gradient: 54 MB for the
4096x3328 layer of the 17M-parameter MLP) is still mapped fresh there every step whatever the
threshold (13,313 page faults a step in tower 1, none in tower 0, measured). In the main arena
the threshold holds for every tower. The towers allocate a few large tensors per op, so they
rarely meet on the arena's lock. Measured in benchmarks/results/lab-notes.md, "Towers in one
process"; `TOWERFLOW_TOWERS_ALLOCATOR=system` leaves malloc as the system has it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from typing import Optional

log = logging.getLogger("towerflow.strategies")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 1 << 30  # chunks below 1 GiB come from the heap (a gradient set of up to 250M float32 parameters)
GLIBC_CAP = 32 << 20  # what older glibc accepts at most for the mmap threshold
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: freed memory is kept up to 2 GiB at the heap's top

_lock = threading.Lock()
_applied: Optional[str] = None  # what was set, once per process


def keep_freed_memory() -> str:
    """Tune glibc malloc for this process (once); says what was done (kept as `strategy.host_memory`, logged)."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _tune()
            log.info("towers: %s", _applied)
        return _applied


def _tune() -> str:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"malloc left as it is: no glibc mallopt in {name or 'this process'}"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    threshold = next((t for t in (MMAP_THRESHOLD, GLIBC_CAP) if mallopt(_M_MMAP_THRESHOLD, t) == 1), None)
    if threshold is None or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "malloc left as it is: glibc refused the settings"
    arenas = ", one arena" if mallopt(_M_ARENA_MAX, 1) == 1 else ""  # before the towers' threads start (see above)
    return f"freed memory kept for reuse (glibc mmap threshold {threshold >> 20} MB, trim threshold 2 GB{arenas})"
