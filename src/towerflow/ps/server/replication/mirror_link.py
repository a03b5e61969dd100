"""Replication ops from a primary to a backup of the same host through shared memory.

A push's op carries the worker's gradients, one flat tensor per dtype, every step. Over a remote call
they would cross the loopback's TCP stack and two messaging threads on each side. On one host the
primary writes them into a ring in shared memory that the backup maps (`cluster/link/shm_ring.py`): once
written, the op is in the backup's memory and counts as held, and the backup, which needs its ops only
when its state is read (`mirror.py`), takes them from the ring then, or when another op arrives. Nobody
wakes per op. When the ring is full (the backup has not taken its ops for a while), or where the ring
is not supported, the op goes through a shared request slot of a link (`cluster/link/shm_link.py`) whose
small header goes down a pipe; the backup's link thread hands it to the mirror, which first takes what
the ring holds, and answers with the mirror's acknowledgement. The link's pipe also tells the primary
that the backup's process is gone. A thread of the primary that may wait (a worker's same-host link
thread) opens one such link of its own, as it would a direct channel; ops of other kinds (table rows,
a finish, a seed) keep the remote call, and the mirror puts the paths back in order by their numbers.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from towerflow import _log
from towerflow.cluster.link import shm_link
from towerflow.cluster.link import shm_ring
from towerflow.errors import ConnectionLost, ParameterServerError
from towerflow.ps.messages import PUSH_KINDS, Ticket
from towerflow.ps.replication_messages import MIRROR_HOLD_BYTES, REFRESH_OPS, PushOp, ReplicaFrame

RING_BYTES = MIRROR_HOLD_BYTES // 2  # a ring's records at most: what a refreshed mirror holds between seeds
RING_MIN_SLOTS = 8  # fewer records of a large push would fill it too often to save a wake-up
RING_MAX_SLOTS = 2 * REFRESH_OPS  # a small state's mirror is seeded anew after half as many ops (fresh_seeds.FreshSeeds)


class _SlotAck:
    """An op sent through a slot: `result()` reads the backup's acknowledgement once (kept for a second read)."""

    def __init__(self, link: shm_link.LinkClient, slot: int):
        self.link, self.slot = link, slot
        self._value: Optional[int] = None

    def result(self) -> int:
        if self._value is None:
            self._value = int(self.link.reply(self.slot))
        return self._value


class _RingHeld:
    """An op written into the ring: held by the backup as it stands (`op_held`), whatever came before it."""

    op_held = True

    @staticmethod
    def result() -> int:
        return 0


_RING_HELD = _RingHeld()


PUSH_FIELDS = ("seq", "worker", "step", "gap", "lr", "kind")  # a push's values in a ring record or a slot's header


def push_values(frame: ReplicaFrame) -> Tuple[float, ...]:
    """What a push's op carries beside its gradients, as numbers (the link's own fields are fixed)."""
    op = frame.op
    return (frame.seq, op.worker, op.ticket.step, op.ticket.gap, math.nan if op.lr is None else op.lr,
            PUSH_KINDS.index(op.kind))


def push_frame(model: str, primary: int, sender: str, values: Tuple[float, ...], grads: List[torch.Tensor]) -> ReplicaFrame:
    """The op of a ring record or a slot, its gradients copied out (the primary writes the slot again)."""
    seq, worker, step, gap, lr, kind = values
    op = PushOp(int(worker), Ticket(int(step), int(gap)), [g.clone() for g in grads], None if math.isnan(lr) else lr,
                None, PUSH_KINDS[int(kind)])
    return ReplicaFrame(model, primary, sender, int(seq), op)


class LinkSender:
    """This thread's link to the backup: pushes with dense gradients through the ring (else the slots), the rest by
    `other`."""

    def __init__(self, link: shm_link.LinkClient, specs: Sequence[tuple], other: Callable[[ReplicaFrame], object],
                 ring: Optional[shm_ring.RingWriter] = None):
        self.link, self.specs, self.other, self.ring = link, tuple(specs), other, ring
        self._next = 0
        self._unread: List[Optional[_SlotAck]] = [None] * shm_link.SLOTS
        self.ring_ops = 0
        self._seeds, self._written_at_seed = 0, 0  # the backup's last seed this thread saw, and the ring's count then

    def __call__(self, frame: ReplicaFrame):
        op = frame.op
        if not (isinstance(op, PushOp) and op.rows is None
                and tuple((g.numel(), g.dtype) for g in op.grads) == self.specs):
            return self.other(frame)
        if self.ring is not None and self.ring.put(op.grads, push_values(frame)):
            if self.ring.closed:
                raise ParameterServerError(f"the backup's mirror of /job:ps/task:{frame.primary}'s part of "
                                           f"{frame.model!r} takes no more ops from {frame.sender} (it was promoted)")
            if self.link.peer_gone():
                raise ConnectionLost("the link's server is gone (its pipe hung up)")
            self.ring_ops += 1
            return _RING_HELD
        slot = self._next
        self._next = (slot + 1) % shm_link.SLOTS
        if self._unread[slot] is not None:  # its last op's ack must be in before the slot is written again
            self._unread[slot].result()
        torch._foreach_copy_(self.link.requests[slot], list(op.grads))
        self.link.call(slot, (frame.model, frame.primary, frame.sender, push_values(frame)))  # plain values: pickled
        # in a fraction of the dataclasses' time
        ack = self._unread[slot] = _SlotAck(self.link, slot)
        return ack

    def ring_half_full(self, seeds: int) -> bool:
        """Whether half of the ring's slots hold records the backup has not taken that were written after its seed
        number `seeds` (the backup skips those before once that seed reaches it: it need not be seeded again)."""
        ring = self.ring
        if ring is None:
            return False
        if seeds != self._seeds:
            self._seeds, self._written_at_seed = seeds, ring.written
        return 2 * min(ring.untaken, ring.written - self._written_at_seed) >= ring.offer.slots

    def close(self) -> None:
        """The backup is lost: close the link, the ring and the other connection."""
        self.link.close()
        if self.ring is not None:
            self.ring.unlink()
        close = getattr(self.other, "close", None)
        if close is not None:
            close()


def open_sender(flats: Sequence[torch.Tensor],
                offer_to: Callable[[shm_link.LinkOffer, Optional[shm_ring.RingOffer]], bool],
                other: Callable[[ReplicaFrame], object], who: str) -> Optional[LinkSender]:
    """A link whose slots fit the primary's flat tensors, with a ring of them where supported, accepted by the backup
    (`offer_to`), or None (the ops then go by `other` alone): shared memory too small, or the backup on another host
    after all."""
    specs = tuple((f.numel(), f.dtype) for f in flats)
    if not specs:
        return None
    try:
        link = shm_link.LinkClient(specs, ())
    except OSError as e:
        _log.get("ps", who).warning(f"no shared-memory link to its backup ({e}); its ops go over remote calls")
        return None
    ring = _open_ring(specs, who)
    try:
        if not offer_to(link.offer, ring.offer if ring is not None else None):
            link.close()
            return None
        link.connect()
    except BaseException:
        link.close()
        raise
    finally:
        if ring is not None:
            ring.unlink()  # mapped by the backup by now, or never to be
    return LinkSender(link, specs, other, ring)


def _open_ring(specs: Sequence[tuple], who: str) -> Optional[shm_ring.RingWriter]:
    record = sum(n * torch.empty(0, dtype=d).element_size() for n, d in specs)
    slots = min(RING_BYTES // max(record, 1), RING_MAX_SLOTS)
    if slots < RING_MIN_SLOTS or not shm_ring.supported():
        return None
    try:
        return shm_ring.RingWriter(specs, len(PUSH_FIELDS), slots)
    except OSError as e:
        _log.get("ps", who).warning(f"no shared-memory ring to its backup ({e}); its pushes wake it each time")
        return None


def handler(receive: Callable[[ReplicaFrame], torch.futures.Future]) -> shm_link.Handler:
    """The backup's side: the op with its gradients copied out of the slot (the primary writes it again two ops
    later), handed to the mirror; the reply is the mirror's acknowledgement."""

    def handle(head: tuple, grads: List[torch.Tensor], _reply: List[torch.Tensor]) -> torch.futures.Future:
        model, primary, sender, values = head
        return receive(push_frame(model, primary, sender, values, grads))

    return handle


def attach_ring(offer: Optional[shm_ring.RingOffer]) -> Optional[shm_ring.RingReader]:
    """The backup's end of a primary's ring (None: no ring offered)."""
    return shm_ring.RingReader(offer) if offer is not None else None
