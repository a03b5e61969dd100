"""`IdMap`: int64 id -> int64 slot, looked up a whole batch at a time in tensors.

A ps answers a pull of tens of thousands of ids per step; a Python dict pays an
interpreter round and a cache miss per id (about 10x slower than this on 26k ids of a
1M-id table: benchmarks/results/row_stores.log). This is an open-addressing table with linear probing held in two 1-D
tensors, ids and slots (a 1-D gather is several times faster than one of [n, 2] rows), so
a batch lookup is a few vectorized ops: each id's window of `WINDOW` neighbouring
positions is read at once, and only the rare id whose window is full of other ids goes
round again.

A slot is >= 0, or EMPTY (never used: a probe stops there) or GONE (removed: a probe goes
on past it, an insert may reuse it). The table is rebuilt, doubled, before live and GONE
positions fill half of it, which keeps probes short.
"""

from __future__ import annotations

import torch

EMPTY, GONE = -1, -2
WINDOW = 4  # positions read per id per round
_MULT = -7046029254386353131  # 0x9E3779B97F4A7C15 (Fibonacci hashing) as a signed int64; the product wraps
_MIN_BITS = 6


class IdMap:
    """A set of unique int64 ids (any value), each mapped to an int64 slot >= 0."""

    def __init__(self):
        self._offsets = torch.arange(WINDOW, dtype=torch.int64)
        self._alloc(_MIN_BITS)

    def _alloc(self, bits: int) -> None:
        self._bits, self._mask = bits, (1 << bits) - 1
        self._keys = torch.zeros(1 << bits, dtype=torch.int64)
        self._slots = torch.full((1 << bits,), EMPTY, dtype=torch.int64)
        self._live = self._gone = 0

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return (self._keys.numel() + self._slots.numel()) * 8

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        return ((ids * _MULT) >> (64 - self._bits)) & self._mask

    def _probe(self, ids: torch.Tensor, want_positions: bool) -> torch.Tensor:
        """Each id's slot (or table position), -1 where it is absent."""
        out = torch.full((ids.numel(),), -1, dtype=torch.int64)
        todo = None  # the rows of `out` still probing, None while it is all of them
        home = self._home(ids)
        while ids.numel():
            win = (home.unsqueeze(1) + self._offsets).bitwise_and_(self._mask)
            flat = win.view(-1)
            slots = self._slots.index_select(0, flat).view(win.shape)
            live = (self._keys.index_select(0, flat).view(win.shape) == ids.unsqueeze(1)) & (slots >= 0)
            # an id is live at one position at most
            found = torch.where(live, win if want_positions else slots, -1).amax(1)
            if todo is None:
                out = found
            else:
                out[todo] = found
            # absent once the probe has passed an EMPTY position; else look at the next window
            more = (found < 0) & (slots != EMPTY).all(1)
            if not more.any():
                break
            rows = more.nonzero().squeeze(1)
            todo = rows if todo is None else todo.index_select(0, rows)
            ids, home = ids.index_select(0, rows), (home.index_select(0, rows) + WINDOW) & self._mask
        return out

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where it is absent."""
        return self._probe(ids, want_positions=False)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ids that are absent (and unique among themselves) with their slots."""
        n = ids.numel()
        if not n:
            return
        if 2 * (self._live + self._gone + n) > self._mask + 1:
            self._rebuild(self._live + n)
        home = self._home(ids)
        while ids.numel():
            win = (home.unsqueeze(1) + self._offsets).bitwise_and_(self._mask)
            free = self._slots.index_select(0, win.view(-1)).view(win.shape) < 0
            has = free.any(1)
            first = win.gather(1, free.to(torch.uint8).argmax(1, keepdim=True)).squeeze(1)
            # of the ids that want the same free position, the first takes it; the others probe on
            want = has.nonzero().squeeze(1)
            at, order = torch.sort(first.index_select(0, want), stable=True)
            lead = torch.ones_like(at, dtype=torch.bool)
            lead[1:] = at[1:] != at[:-1]
            won, at = want.index_select(0, order[lead]), at[lead]
            self._gone -= int((self._slots.index_select(0, at) == GONE).sum())
            self._keys[at] = ids.index_select(0, won)
            self._slots[at] = slots.index_select(0, won)
            left = torch.ones(ids.numel(), dtype=torch.bool)
            left[won] = False
            home = torch.where(has, home, (home + WINDOW) & self._mask)  # a full window: look further on
            rows = left.nonzero().squeeze(1)
            ids, slots, home = ids.index_select(0, rows), slots.index_select(0, rows), home.index_select(0, rows)
        self._live += n

    def remove(self, ids: torch.Tensor) -> None:
        """Drop those of `ids` that are present."""
        at = self._probe(ids, want_positions=True)
        at = at[at >= 0]
        self._slots[at] = GONE
        self._live -= at.numel()
        self._gone += at.numel()

    def _rebuild(self, need: int) -> None:
        live = self._slots >= 0
        ids, slots = self._keys[live], self._slots[live]
        bits = _MIN_BITS
        while 2 * need > (1 << bits):
            bits += 1
        self._alloc(bits)
        self.insert(ids, slots)
