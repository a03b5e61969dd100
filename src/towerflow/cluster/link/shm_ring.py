"""A same-host ring of fixed-shape records in shared memory, written by one process and read by another only when
it wants them.

`shm_link.py` rings a doorbell for every call: the reader's thread wakes, takes the request and answers. Some
traffic needs no answer and no wake-up, only the certainty that the reader *has* the record, should the
writer die right after: a ps primary's pushes to a same-host backup, which the backup reads only when its
state is asked for. Once written here a record is in memory the reader maps, and that memory outlives the
writer, so the writer may count it as held at once.

Each slot holds one record: its tensors (the writer's `specs`) and a row of float64 values whose first cell,
the slot's ticket (the record's number, counted from 1), is written last: a reader takes a slot only when its
ticket is the next number, so it never reads a half-written record. The reader's count of records taken lives
in shared memory too, and the writer fills a slot only after the reader took its previous record (`put`
returns False while the ring is full). A reader that will take no more (it was promoted, or it dropped the
ring) says so with `close`, which the writer sees on its next `put`.

The ticket protocol relies on stores becoming visible to other processes in program order, which x86-64
guarantees (TSO); `supported()` is False elsewhere and callers keep their doorbell there. The files are
mapped from /dev/shm (`torch.from_file(shared=True)`: PyTorch's shared memory) and unlinked by the writer once
the reader mapped them (those of a writer killed before are swept by the next one: `shm_link.new_prefix`).
"""

from __future__ import annotations

import dataclasses
import platform
from typing import Callable, List, Sequence, Tuple

import torch

from towerflow.cluster.link.shm_link import SHM_DIR, TensorSpecs, mapped, new_prefix, unlink_all

_TAKEN, _CLOSED = 0, 1  # cells of the control block


def supported() -> bool:
    """Whether this machine orders stores as the tickets need (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


@dataclasses.dataclass(frozen=True)
class RingOffer:
    """What the writer sends (over a remote call) to the reader: where the ring's files are and their shape."""

    prefix: str  # /dev/shm/towerflow-ring-<pid>-<random>: the files are prefix + ".d<i>", ".head", ".ctl"
    specs: TensorSpecs  # (numel, dtype) of each tensor of a record
    values: int  # float64 values of a record beside its ticket
    slots: int

    def path(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"


class _Ring:
    def __init__(self, offer: RingOffer, create: bool):
        self.offer = offer
        data = [mapped(offer.path(f"d{i}"), n * offer.slots, d, create).view(offer.slots, n)
                for i, (n, d) in enumerate(offer.specs)]
        self.records: List[List[torch.Tensor]] = [[t[k] for t in data] for k in range(offer.slots)]
        self.heads = mapped(offer.path("head"), offer.slots * (1 + offer.values), torch.float64, create).view(
            offer.slots, 1 + offer.values).numpy()
        self.control = mapped(offer.path("ctl"), 2, torch.int64, create).numpy()


class RingWriter(_Ring):
    """The writer's end: creates the files; `put` copies a record in, or returns False while the ring is full."""

    def __init__(self, specs: Sequence[Tuple[int, torch.dtype]], values: int, slots: int, directory: str = SHM_DIR):
        """Raises OSError when the ring does not fit in `directory` (ENOSPC); nothing is left behind then."""
        offer = RingOffer(new_prefix("ring", directory), tuple(specs), values, slots)
        self._paths = [offer.path(f"d{i}") for i in range(len(offer.specs))] + [offer.path("head"), offer.path("ctl")]
        try:
            super().__init__(offer, create=True)
        except OSError:
            self.unlink()
            raise
        self.written = 0

    @property
    def closed(self) -> bool:
        """The reader takes no more records (`RingReader.close`)."""
        return bool(self.control[_CLOSED])

    @property
    def untaken(self) -> int:
        """How many records the reader has not taken yet (`put` fails once every slot holds one)."""
        return self.written - int(self.control[_TAKEN])

    def put(self, tensors: Sequence[torch.Tensor], values: Sequence[float]) -> bool:
        """Copy one record into the next slot and publish it; False (nothing written) while every slot holds a
        record the reader has not taken."""
        if self.untaken >= self.offer.slots:
            return False
        k = self.written % self.offer.slots
        torch._foreach_copy_(self.records[k], list(tensors))
        head = self.heads[k]
        head[1:] = values
        head[0] = self.written + 1  # the ticket, last: the record is whole once it reads so
        self.written += 1
        return True

    def unlink(self) -> None:
        """Remove the files' names (the mappings stay valid on both sides)."""
        unlink_all(self._paths)


class RingReader(_Ring):
    """The reader's end, mapped from a writer's offer (FileNotFoundError: the files are not on this host)."""

    def __init__(self, offer: RingOffer):
        super().__init__(offer, create=False)

    def take(self, visit: Callable[[Tuple[float, ...], List[torch.Tensor]], None]) -> int:
        """Call `visit(values, tensors)` for each record published since the last take, in order, then free its slot
        (`visit` copies what it keeps: the writer fills the slot again); the number of records taken."""
        taken = start = int(self.control[_TAKEN])
        slots = self.offer.slots
        while self.heads[taken % slots, 0] == taken + 1:
            visit(tuple(self.heads[taken % slots, 1:].tolist()), self.records[taken % slots])
            taken += 1
            self.control[_TAKEN] = taken
        return taken - start

    def close(self) -> None:
        """Take no more records; the writer's next `put` sees it (`RingWriter.closed`)."""
        self.control[_CLOSED] = 1

    def let_go(self) -> None:
        """Unmap this end (closed first): the memory goes back once the writer lets go of its end too."""
        self.close()
        self.records, self.heads, self.control = [], None, None
