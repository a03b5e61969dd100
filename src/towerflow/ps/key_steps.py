"""A batch's row keys as they cross the wire: the first key and the steps between them, in one or two bytes.

A read or a push names every row it carries by its key on the ps task: 4 bytes (int32) against the 64 of a
row of dimension 16, so the keys alone add 6% to a sparse step's bytes, both ways. The keys of one table
on one task come from `torch.unique` and are ascending, so the steps between neighbours are small: a batch
of 1,000 rows out of a shard of 500,000 steps ~500 on average. Sent as the first key and its steps in
uint8 (every step within 256 of the smallest) or int16 (within 65,536), they cost 1 or 2 bytes a row.
Keys whose steps spread wider, and short runs where the header would cost more, travel as they are.

`pack` is called once per read on the worker (the push reuses the read's packed keys), `unpack` on the
ps task; either side counts `nbytes` of the packed form, which is what travels.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Tuple, Union

import numpy as np
import torch

# Fewer keys than this travel as they are: the steps' header (first, smallest step, dtype) outweighs the saving.
MIN_PACKED = 16
_HEADER_BYTES = 16  # first key and smallest step, as counted against the plain keys

_INT16_OFFSET = 32768  # int16 holds a step's distance from the smallest one, shifted to start at -32768


@dataclasses.dataclass(frozen=True)
class KeySteps:
    """Ascending-ish keys as `first` and each following key's step from the one before, stored as
    `steps - smallest` in uint8, or shifted into int16; `dtype` is the keys' own (int32 or int64)."""

    first: int
    smallest: int
    steps: torch.Tensor
    dtype: torch.dtype

    def unpack(self) -> torch.Tensor:
        steps = self.steps.numpy()  # numpy: a fraction of torch's cost per call on arrays this small
        keys = np.empty(steps.size + 1, dtype=np.int64)
        keys[0] = self.first
        keys[1:] = steps
        keys[1:] += self.smallest + (_INT16_OFFSET if steps.dtype == np.int16 else 0)
        np.cumsum(keys, out=keys)
        return torch.from_numpy(keys.astype(_NUMPY[self.dtype], copy=False))

    @property
    def nbytes(self) -> int:
        return self.steps.numel() * self.steps.element_size() + _HEADER_BYTES

    def numel(self) -> int:
        return self.steps.numel() + 1


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64}

WireKeys = Union[torch.Tensor, KeySteps]


def pack(keys: torch.Tensor) -> WireKeys:
    """`keys` (1-D, int32 or int64) in the fewest bytes: as `KeySteps` when their steps fit, else as they are."""
    if keys.numel() < MIN_PACKED or keys.dim() != 1 or keys.device.type != "cpu":
        return keys
    plain = keys.numpy()
    wide = plain.astype(np.int64, copy=False)
    steps = wide[1:] - wide[:-1]  # np.diff costs 15 us more per call
    smallest, largest = int(steps.min()), int(steps.max())
    spread = largest - smallest
    if spread < 256:
        packed = (steps - smallest).astype(np.uint8)
    elif spread < 65536:
        packed = (steps - (smallest + _INT16_OFFSET)).astype(np.int16)
    else:
        return keys
    if packed.nbytes + _HEADER_BYTES >= plain.nbytes:
        return keys
    return KeySteps(int(plain[0]), smallest, torch.from_numpy(packed), keys.dtype)


def unpack(keys: WireKeys) -> torch.Tensor:
    """The keys as a tensor, whichever form they travelled in."""
    return keys.unpack() if isinstance(keys, KeySteps) else keys


def unpack_all(keys: Iterable[WireKeys]) -> Tuple[torch.Tensor, ...]:
    return tuple(unpack(k) for k in keys)


def nbytes(keys: WireKeys) -> int:
    """The bytes `keys` take on the wire."""
    return keys.nbytes if isinstance(keys, KeySteps) else keys.numel() * keys.element_size()
