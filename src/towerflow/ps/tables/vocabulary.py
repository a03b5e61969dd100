"""`HashRows`: a table shard keyed by arbitrary int64 ids, whose vocabulary grows and shrinks.

Recommendation and ads models see ids (users, items, hashed features) that no fixed table
can hold: Monolith keeps a hash table per ps shard that creates a row the first time (or the
n-th time) an id is seen and evicts rows not touched for a while. Here:

* `read(ids, step)` counts one sighting per id; an id gets a row (N(0, init_std) from a seeded
  generator, fresh optimizer state) when its sightings reach `admit_after`. Until then it
  reads the default row (zeros) and has no state, so rare ids cost nothing.
* `apply(ids, grads, step)` updates the rows that exist; gradients of ids without a row are
  dropped (never admitted, or evicted since the read).
* `evict(step)` removes every row untouched (not read nor updated) for `evict_after` steps;
  its slot is reused and the id starts over, sightings from 0.

Everything on the hot path is vectorized: values, optimizer state, last-touched steps and
free slots live in tensors that grow by doubling, and the id -> slot map is an open-addressing
table in a tensor (`_id_map.py`). Only sightings of ids not admitted yet are a Python dict.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from towerflow.errors import ParameterServerError
from towerflow.ps.tables._id_map import IdMap
from towerflow.ps.tables.row_optimizers import RowOptimizer, State
from towerflow.ps.tables.rows import check_ids, check_keys, check_rows, check_state

_MIN_CAPACITY = 64
TOUCHED = "last_touched"  # the extra per-row tensor `export` adds to the optimizer state


def _check_new(ids: torch.Tensor, what: str) -> torch.Tensor:
    """`ids` without rows, checked unique before anything changes: the id map must not hold one twice."""
    if ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():  # cheap: new ids only, not the whole call
        raise ParameterServerError(
            f"{what}: an id without a row appears twice in one call ({ids.tolist()[:8]}...): ids must be unique; "
            "coalesce them first (towerflow.ps.tables.row_optimizers.coalesce sums the gradients of repeated ids)"
        )
    return ids


def _positive_int(value, allow_none: bool = False) -> bool:
    if value is None:
        return allow_none
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class HashRows:
    """A growing vocabulary of `dim`-wide rows keyed by int64 ids, with row-wise optimizer state."""

    def __init__(self, dim: int, optimizer: RowOptimizer, dtype: torch.dtype = torch.float32, init_std: float = 0.01,
                 seed: int = 0, admit_after: int = 1, evict_after: Optional[int] = None,
                 forget_after: Optional[int] = None):
        if not _positive_int(dim):
            raise ParameterServerError(f"HashRows(dim={dim!r}): expected an int >= 1, the width of a row")
        if not isinstance(optimizer, RowOptimizer):
            raise ParameterServerError(
                f"HashRows(optimizer={optimizer!r}): expected a RowOptimizer (towerflow.ps.SparseSGD, SparseAdagrad, "
                "SparseAdam or FTRL); row_optimizer_for(torch_optimizer) gives the one matching a torch optimizer"
            )
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ParameterServerError(f"HashRows(dtype={dtype!r}): expected a floating torch.dtype such as torch.float32")
        if not init_std >= 0:
            raise ParameterServerError(f"HashRows(init_std={init_std!r}): expected a standard deviation >= 0")
        if not _positive_int(admit_after):
            raise ParameterServerError(
                f"HashRows(admit_after={admit_after!r}): expected an int >= 1, the number of reads of an id that "
                "create its row (1: its first read does)"
            )
        if not _positive_int(evict_after, allow_none=True):
            raise ParameterServerError(
                f"HashRows(evict_after={evict_after!r}): expected None (rows are never evicted) or an int >= 1, the "
                "steps a row may go untouched before evict(step) removes it"
            )
        if not _positive_int(forget_after, allow_none=True):
            raise ParameterServerError(
                f"HashRows(forget_after={forget_after!r}): expected None (sightings of ids not admitted are kept until "
                "they are) or an int >= 1, the steps an id may go unseen before its count starts over"
            )
        self.dim, self.optimizer, self.dtype, self.init_std = dim, optimizer, dtype, float(init_std)
        self.admit_after, self.evict_after, self.forget_after = admit_after, evict_after, forget_after
        self._generator = torch.Generator().manual_seed(seed)
        self.admitted = self.evicted = 0  # rows created and removed, since the start
        self.updates = 0  # applies so far: the `step` torch counts per parameter (Adam's bias correction)
        self._clock = 0  # the latest step seen
        self._reset(_MIN_CAPACITY)

    def _reset(self, capacity: int) -> None:
        self._slot_of = IdMap()  # id -> slot of a live row
        self._pending: Dict[int, Tuple[int, int]] = {}  # id -> (sightings, last step seen), for ids not admitted yet
        self._swept = 0  # the step of the last sweep of expired sightings
        self._free = torch.zeros(capacity, dtype=torch.int64)  # a stack of evicted rows' slots, reused first
        self._free_count = 0
        self._used = 0  # slots [0, _used) have been handed out
        self._values = torch.zeros(capacity, self.dim, dtype=self.dtype)
        self._state: State = self.optimizer.init_state(self._values)
        self._ids = torch.zeros(capacity, dtype=torch.int64)
        self._touched = torch.zeros(capacity, dtype=torch.int64)
        self._live = torch.zeros(capacity, dtype=torch.bool)

    # ---- slots
    def _grow(self, need: int) -> None:
        capacity = self._values.shape[0]
        if need <= capacity:
            return
        capacity = max(need, 2 * capacity)

        def grown(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros((capacity,) + tuple(t.shape[1:]))
            out[: t.shape[0]] = t
            return out

        self._values, self._ids, self._touched, self._live, self._free = map(
            grown, (self._values, self._ids, self._touched, self._live, self._free))
        self._state = {k: grown(v) for k, v in self._state.items()}

    def _claim(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots for new rows of `ids` (freed slots first), registered as live; contents are the caller's."""
        reuse = min(ids.numel(), self._free_count)
        fresh = ids.numel() - reuse
        self._free_count -= reuse
        self._grow(self._used + fresh)
        slots = torch.cat([self._free[self._free_count: self._free_count + reuse],
                           torch.arange(self._used, self._used + fresh, dtype=torch.int64)])
        self._used += fresh
        self._slot_of.insert(ids, slots)
        self._ids[slots] = ids
        self._live[slots] = True
        return slots

    def _admit(self, ids: torch.Tensor, slots: torch.Tensor, step: int) -> None:
        """Count a sighting of each id without a row; create the rows of those that reach admit_after.

        With forget_after, an id unseen for forget_after steps starts its count over.
        """
        new = (slots < 0).nonzero().squeeze(1)
        _check_new(ids.index_select(0, new), "HashRows.read")
        if self.admit_after > 1:
            pending, need, ready = self._pending, self.admit_after, []
            expired = step - self.forget_after if self.forget_after is not None else None
            for key in ids.index_select(0, new).tolist():
                seen, last = pending.get(key, (0, step))
                seen = 1 if expired is not None and last <= expired else seen + 1
                ready.append(seen >= need)
                if seen >= need:
                    pending.pop(key, None)
                else:
                    pending[key] = (seen, step)
            new = new[torch.tensor(ready, dtype=torch.bool)]
        if not new.numel():
            return
        created = self._claim(ids.index_select(0, new))
        init = torch.randn(new.numel(), self.dim, generator=self._generator).mul_(self.init_std).to(self.dtype)
        self._values.index_copy_(0, created, init)
        for name, fresh in self.optimizer.init_state(init).items():
            self._state[name].index_copy_(0, created, fresh)
        slots[new] = created
        self.admitted += new.numel()

    # ---- the hot path
    def read(self, ids: torch.Tensor, step: int, count: bool = True) -> torch.Tensor:
        """The rows of `ids` (unique) at `step`, [len(ids), dim]: zeros for ids not admitted (yet). `count=False`:
        the read was counted already (sent again after a restore): no sighting counted, no id admitted."""
        ids = check_ids(ids, "HashRows.read")
        slots = self._slot_of.lookup(ids)
        self._clock = max(self._clock, step)
        if bool((slots < 0).any()):
            if count:
                self._admit(ids, slots, step)
            hit = (slots >= 0).nonzero().squeeze(1)
            if hit.numel() < ids.numel():
                slots = slots.index_select(0, hit)
                out = torch.zeros(ids.numel(), self.dim, dtype=self.dtype)
                out.index_copy_(0, hit, self._values.index_select(0, slots))
                self._touched.index_fill_(0, slots, step)
                return out
        self._touched.index_fill_(0, slots, step)
        return self._values.index_select(0, slots)

    def peek(self, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(those of `ids` that have rows, their rows), copies; nothing counted, admitted or touched (a publisher's
        read)."""
        ids = check_ids(ids, "HashRows.peek")
        slots = self._slot_of.lookup(ids)
        hit = (slots >= 0).nonzero().squeeze(1)
        return ids.index_select(0, hit), self._values.index_select(0, slots.index_select(0, hit))

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, step: int, lr: Optional[float] = None,
              lr_scale: float = 1.0) -> None:
        """One update of the rows of `ids` (unique) that exist, with their coalesced gradients; the rest are dropped."""
        ids = check_ids(ids, "HashRows.apply")
        grads = check_rows("HashRows.apply", ids.numel(), self.dim, self.dtype, grads)
        slots = self._slot_of.lookup(ids)
        self._clock = max(self._clock, step)
        self.updates += 1
        if bool((slots < 0).any()):
            present = (slots >= 0).nonzero().squeeze(1)
            slots, grads = slots.index_select(0, present), grads.index_select(0, present)
        if slots.numel():
            self.optimizer.apply(self._values, self._state, slots, grads, self.updates, lr, lr_scale)
            self._touched.index_fill_(0, slots, step)

    def evict(self, step: int) -> int:
        """Remove every row last touched at or before step - evict_after; how many went (`evict_ids`)."""
        return self.evict_ids(step).numel()

    def evict_ids(self, step: int) -> torch.Tensor:
        """Remove every row last touched at or before step - evict_after; the ids removed.

        With forget_after, every forget_after steps it also drops the expired sightings of ids not
        admitted, so those held are the ids seen in the last 2 x forget_after steps at most.
        """
        none = torch.zeros(0, dtype=torch.int64)
        if self.forget_after is not None and self._pending and step - self._swept >= self.forget_after:
            expired = step - self.forget_after
            self._pending = {key: seen for key, seen in self._pending.items() if seen[1] > expired}
            self._swept = step
        if self.evict_after is None:
            return none
        used = self._used
        dead = (self._live[:used] & (self._touched[:used] <= step - self.evict_after)).nonzero().squeeze(1)
        if not dead.numel():
            return none
        self._live[dead] = False
        ids = self._ids.index_select(0, dead)
        self._slot_of.remove(ids)
        self._free[self._free_count: self._free_count + dead.numel()] = dead
        self._free_count += dead.numel()
        self.evicted += dead.numel()
        return ids

    # ---- what it holds
    @property
    def rows_held(self) -> int:
        return len(self._slot_of)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors held, at their allocated capacity (not the dict of pending sightings)."""
        held = (self._values, self._ids, self._touched, self._live, self._free, *self._state.values())
        return sum(t.numel() * t.element_size() for t in held) + self._slot_of.nbytes

    def metrics(self) -> Dict[str, int]:
        return {"rows": len(self._slot_of), "admitted": self.admitted, "evicted": self.evicted,
                "pending": len(self._pending)}

    def __contains__(self, key: int) -> bool:
        return int(self._slot_of.lookup(torch.tensor([int(key)]))[0]) >= 0

    # ---- checkpoints and resharding
    def _live_slots(self) -> torch.Tensor:
        return self._live[: self._used].nonzero().squeeze(1)

    def export(self) -> Tuple[torch.Tensor, torch.Tensor, State]:
        """Every live row: (ids int64, values, state), the state with `last_touched` [n] beside the optimizer's."""
        live = self._live_slots()
        state = {k: v.index_select(0, live) for k, v in self._state.items()}
        state[TOUCHED] = self._touched.index_select(0, live)
        return self._ids.index_select(0, live), self._values.index_select(0, live), state

    def load_rows(self, ids: torch.Tensor, values: torch.Tensor, state: State, updates: Optional[int] = None) -> None:
        """Write exported rows into this shard (creating or overwriting them; pending sightings of them end).

        Without `last_touched` in `state` the rows count as touched at the latest step this
        shard has seen. `updates` only ever raises the update count (see FixedRows.load_rows).
        """
        what = "HashRows.load_rows"
        ids = check_ids(ids, what)
        n = ids.numel()
        values = check_rows(what, n, self.dim, self.dtype, values, "values")
        check_state(what, self.optimizer, state, n, self.dim, optional=(TOUCHED,))
        touched = state.get(TOUCHED)
        if touched is not None and tuple(touched.shape) != (n,):
            raise ParameterServerError(f"{what}: state[{TOUCHED!r}] has shape {tuple(touched.shape)}, expected ({n},)")
        slots = self._slot_of.lookup(ids)
        missing = (slots < 0).nonzero().squeeze(1)
        if missing.numel():
            slots[missing] = self._claim(_check_new(ids.index_select(0, missing), what))
        if self._pending:
            for key in ids.tolist():
                self._pending.pop(key, None)
        self._values.index_copy_(0, slots, values)
        for name in self.optimizer.state_names:
            self._state[name].index_copy_(0, slots, state[name].to(self.dtype))
        if touched is None:
            self._touched.index_fill_(0, slots, self._clock)
        else:
            self._touched.index_copy_(0, slots, touched.long())
        if updates is not None:
            self.updates = max(self.updates, int(updates))

    def state_dict(self) -> dict:
        """Live rows (ids, values, state, last touched), pending sightings, counters and the init generator."""
        ids, values, state = self.export()
        touched = state.pop(TOUCHED)
        return {"dim": self.dim, "ids": ids, "values": values, "state": state, TOUCHED: touched,
                "pending_ids": torch.tensor(list(self._pending), dtype=torch.int64),
                "pending_counts": torch.tensor([seen for seen, _ in self._pending.values()], dtype=torch.int64),
                "pending_steps": torch.tensor([last for _, last in self._pending.values()], dtype=torch.int64),
                "admitted": self.admitted, "evicted": self.evicted, "updates": self.updates, "clock": self._clock,
                "generator": self._generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Replace everything with a `state_dict()` of a HashRows of the same dim and optimizer."""
        what = "HashRows.load_state_dict"
        check_keys(what, state, ("dim", "ids", "values", "state", TOUCHED, "pending_ids", "pending_counts", "admitted",
                                 "evicted", "updates", "clock", "generator"), "HashRows")
        if state.get("dim") != self.dim:
            raise ParameterServerError(
                f"{what}: the checkpoint's rows are {state.get('dim')!r} wide, this table's dim={self.dim!r}; build the "
                "HashRows with the dim the checkpoint was written with"
            )
        ids = check_ids(state["ids"], what)
        n = ids.numel()
        if torch.unique(ids).numel() != n:
            raise ParameterServerError(f"{what}: the checkpoint lists an id twice; it was not written by state_dict()")
        values = check_rows(what, n, self.dim, self.dtype, state["values"], "values")
        check_state(what, self.optimizer, state["state"], n, self.dim)
        self._reset(max(n, _MIN_CAPACITY))
        self.admitted, self.evicted = int(state["admitted"]), int(state["evicted"])
        self.updates, self._clock = int(state["updates"]), int(state["clock"])
        self._generator.set_state(state["generator"])
        self.load_rows(ids, values, {**state["state"], TOUCHED: state[TOUCHED]})
        counts = state["pending_counts"].tolist()
        steps = state["pending_steps"].tolist() if "pending_steps" in state else [self._clock] * len(counts)  # older
        self._pending = dict(zip(state["pending_ids"].tolist(), zip(counts, steps)))

    def __repr__(self) -> str:
        return (f"HashRows(dim={self.dim}, {self.optimizer.describe()}, admit_after={self.admit_after}, "
                f"evict_after={self.evict_after}, forget_after={self.forget_after}, {self.metrics()})")
