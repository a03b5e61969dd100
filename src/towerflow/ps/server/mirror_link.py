"""Replication ops from a primary to a backup of the same host through shared memory (`cluster/shm_link.py`).

A push's op carries the worker's gradients, one flat tensor per dtype, every step. Over a remote call
they would cross the loopback's TCP stack and two messaging threads on each side; on one host the
primary copies them into a shared request slot instead and sends the op's small header down a pipe,
and the backup's link thread, `serve_link`, takes them from the slot and hands the op to its mirror,
answering with the mirror's acknowledgement. A thread of the primary that may wait (a worker's
same-host link thread) opens one such link of its own, as it would a direct channel; ops of other
kinds (table rows, a finish, a seed) keep the remote call, and the mirror puts the two paths back in
order by their numbers.
"""

from __future__ import annotations

import sys
from typing import Callable, List, Optional, Sequence

import torch

from towerflow.cluster import shm_link
from towerflow.ps.messages import Ticket
from towerflow.ps.replication_messages import PushOp, ReplicaFrame


class _SlotAck:
    """An op sent through a slot: `result()` reads the backup's acknowledgement once (kept for a second read)."""

    def __init__(self, link: shm_link.LinkClient, slot: int):
        self.link, self.slot = link, slot
        self._value: Optional[int] = None

    def result(self) -> int:
        if self._value is None:
            self._value = int(self.link.reply(self.slot))
        return self._value


class LinkSender:
    """This thread's link to the backup: pushes with dense gradients only through the slots, the rest by `other`."""

    def __init__(self, link: shm_link.LinkClient, specs: Sequence[tuple], other: Callable[[ReplicaFrame], object]):
        self.link, self.specs, self.other = link, tuple(specs), other
        self._next = 0
        self._unread: List[Optional[_SlotAck]] = [None] * shm_link.SLOTS

    def __call__(self, frame: ReplicaFrame):
        op = frame.op
        if not (isinstance(op, PushOp) and op.rows is None
                and tuple((g.numel(), g.dtype) for g in op.grads) == self.specs):
            return self.other(frame)
        slot = self._next
        self._next = (slot + 1) % shm_link.SLOTS
        if self._unread[slot] is not None:  # its last op's ack must be in before the slot is written again
            self._unread[slot].result()
        torch._foreach_copy_(self.link.requests[slot], list(op.grads))
        self.link.call(slot, (frame.model, frame.primary, frame.sender, frame.seq, op.worker, op.ticket.step,
                              op.ticket.gap, op.lr, op.kind))  # plain values: pickled in a fraction of the dataclasses' time
        ack = self._unread[slot] = _SlotAck(self.link, slot)
        return ack

    def close(self) -> None:
        """The backup is lost: close the link and the other connection."""
        self.link.close()
        close = getattr(self.other, "close", None)
        if close is not None:
            close()


def open_sender(flats: Sequence[torch.Tensor], offer_to: Callable[[shm_link.LinkOffer], bool],
                other: Callable[[ReplicaFrame], object], who: str) -> Optional[LinkSender]:
    """A link whose slots fit the primary's flat tensors, accepted by the backup (`offer_to`), or None (the ops
    then go by `other` alone): shared memory too small, or the backup on another host after all."""
    specs = tuple((f.numel(), f.dtype) for f in flats)
    if not specs:
        return None
    try:
        link = shm_link.LinkClient(specs, ())
    except OSError as e:
        print(f"towerflow: {who}: no shared-memory link to its backup ({e}); its ops go over remote calls",
              file=sys.stderr, flush=True)
        return None
    try:
        if not offer_to(link.offer):
            link.close()
            return None
        link.connect()
    except BaseException:
        link.close()
        raise
    return LinkSender(link, specs, other)


def handler(receive: Callable[[ReplicaFrame], torch.futures.Future]) -> shm_link.Handler:
    """The backup's side: the op with its gradients copied out of the slot (the primary writes it again two ops
    later), handed to the mirror; the reply is the mirror's acknowledgement."""

    def handle(head: tuple, grads: List[torch.Tensor], _reply: List[torch.Tensor]) -> torch.futures.Future:
        model, primary, sender, seq, worker, step, gap, lr, kind = head
        op = PushOp(worker, Ticket(step, gap), [g.clone() for g in grads], lr, None, kind)
        return receive(ReplicaFrame(model, primary, sender, seq, op))

    return handle
