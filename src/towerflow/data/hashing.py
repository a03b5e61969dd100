"""Ids from the values of a categorical column: a stable hash of strings, and hex digits read as numbers.

An embedding row must be the same for a value on every worker, every host and every run, so the
hash is a fixed function of the value's UTF-8 bytes (64-bit FNV-1a, then splitmix64's finalizer so
that the low bits, which pick the row, depend on every byte); Python's `hash()` is salted per process
and never used. Both work on a whole Arrow string column at once: one numpy pass per character
position, not a Python call per value.
"""

from __future__ import annotations

import numpy as np

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_HEX = np.full(256, -1, dtype=np.int64)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i
_HEX8 = _HEX.astype(np.int8)  # the same table in bytes: a look-up over every byte of a column stays small
MAX_HEX_DIGITS = 15  # 60 bits: the value stays a non-negative int64


def _bytes_of(col):
    """(offsets [n + 1], data bytes) of an Arrow string array, its nulls as empty strings."""
    import pyarrow as pa

    col = col.cast(pa.string()).fill_null("")
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int32)[col.offset:col.offset + len(col) + 1].astype(np.int64)
    data = np.frombuffer(col.buffers()[2], dtype=np.uint8) if col.buffers()[2] is not None else np.zeros(0, np.uint8)
    return offsets, data


def stable_hash(col) -> np.ndarray:
    """The 63-bit hash (int64, non-negative) of every string of an Arrow array; a null hashes as ''."""
    offsets, data = _bytes_of(col)
    starts, lengths = offsets[:-1], np.diff(offsets)
    h = np.full(len(lengths), _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(int(lengths.max()) if lengths.size else 0):
            has = lengths > k
            h[has] = (h[has] ^ data[starts[has] + k].astype(np.uint64)) * _FNV_PRIME
        h ^= h >> np.uint64(30)
        h *= _MIX1
        h ^= h >> np.uint64(27)
        h *= _MIX2
        h ^= h >> np.uint64(31)
    return (h >> np.uint64(1)).astype(np.int64)


def hex_ids(col):
    """(ids int64, bad bool) of an Arrow array of hex strings: an empty or missing value is 0; a value that is
    not hex, or longer than MAX_HEX_DIGITS, is marked bad (its id 0)."""
    offsets, data = _bytes_of(col)
    starts, lengths = offsets[:-1], np.diff(offsets)
    bad = lengths > MAX_HEX_DIGITS
    wrong = _HEX8[data[offsets[0]:offsets[-1]]] < 0
    if wrong.any():  # the values holding a byte that is no hex digit
        bad[np.repeat(np.arange(len(lengths)), lengths)[wrong]] = True
    out = np.zeros(len(lengths), dtype=np.int64)
    width = int(lengths.max()) if lengths.size else 0
    has = lengths > 0
    if 0 < width <= MAX_HEX_DIGITS and (lengths[has] == width).all():  # every value as wide (Criteo's 8 digits)
        digits = _HEX8[data[starts[has, None] + np.arange(width)]].astype(np.int64)  # [values, width]
        out[has] = np.maximum(digits, 0) @ (16 ** np.arange(width - 1, -1, -1, dtype=np.int64))
    else:
        for k in range(min(width, MAX_HEX_DIGITS)):  # one digit place at a time
            has = lengths > k
            out[has] = out[has] * 16 + np.maximum(_HEX8[data[starts[has] + k]], 0)
    out[bad] = 0
    return out, bad
