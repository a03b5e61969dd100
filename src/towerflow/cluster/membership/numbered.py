"""Records the tasks append to the store under consecutive numbers: a counter bumped first, then the record.

Losses (`watch.py`), failures (`failures.py`) and changes to the done set (`ending.py`) are published this way, so
a reader keeps the last number it read and reads only what came since, in one batched call. A record is written
after its number is counted, so a reader may find a number whose record is not there yet (its writer is between
the two calls, or died there): each reader decides what that means for it.
"""

from __future__ import annotations

from typing import Dict, Sequence


def read(store, prefix: str, numbers: Sequence[int]) -> Dict[int, bytes]:
    """The records `prefix<n>` of `numbers` that are written, by number: one `check` and one `multi_get` when all
    are, else one `check` (and a `get`) each."""
    keys = [f"{prefix}{n}" for n in numbers]
    if not keys:
        return {}
    if store.check(keys):
        return dict(zip(numbers, store.multi_get(keys)))
    return {n: store.get(key) for n, key in zip(numbers, keys) if store.check([key])}
