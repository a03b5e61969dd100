"""Each thread's own connections from a primary to its backup, and the acks it has still to read on them.

A thread that may wait (a worker's same-host link thread) sends its ops on a connection of its own and reads
their acks itself, when its next reply needs them, instead of two hand-offs to the messaging thread per op
(`cluster/calls/direct.py`, `mirror_link.py`). `replicator.Replicator` decides what is sent and when a reply may go;
this keeps, per thread, which connection each backup has and which acks are unread.
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional, Tuple


class OwnConnections:
    """Per thread: its connection to each backup (opened by `open_to(backup)`; False: it sends by the messaging
    thread)."""

    def __init__(self, open_to: Callable[[str], object], say: Callable[[str], None]):
        self._open = open_to
        self._say = say
        self._local = threading.local()

    def _mine(self) -> threading.local:
        local = self._local
        if not hasattr(local, "channels"):
            local.channels, local.pending, local.wants = {}, [], None
        return local

    def to(self, backup: str):
        """This thread's own connection to `backup` when it has one; else it asks for one, opened by `open_wanted`
        (off the service's lock: opening waits for the backup, whose answer the messaging thread may be unable to
        take while it waits for that lock), and the op goes the shared way meanwhile."""
        local = self._mine()
        send = local.channels.get(backup)
        if send is None:
            local.wants = backup
        return send

    def current(self, backup: str):
        """This thread's own connection to `backup`, if it has one (asking for none)."""
        return getattr(self._local, "channels", {}).get(backup)

    def sent(self, backup: str, seq: int, call: object) -> None:
        """Op `seq` went on this thread's connection; `call.result()` reads its ack."""
        self._local.pending.append((backup, seq, call))

    def open_wanted(self, backup: Optional[str]) -> None:
        """Open the connection this thread asked for, if `backup` is still the backup."""
        local = self._local
        to = getattr(local, "wants", None)
        if to is None:
            return
        local.wants = None
        if to != backup:  # lost meanwhile
            return
        for stale in [b for b in local.channels if b != to]:  # a backup lost while this thread did not call it
            self.drop(stale)
        try:
            send = self._open(to)
        except Exception as error:  # the backup went meanwhile: the next op's call says so
            self._say(f"could not open a direct connection to the backup {to} ({error}); ops go by the messaging thread")
            send = None
        local.channels[to] = send or False

    def unread(self, upto: int) -> List[Tuple[str, int, object]]:
        """The sends whose acks are to be read now: every one but the last (they have most likely arrived; another
        thread's reply may wait for them), and the last too when its number is at most `upto` or it is held as
        sent (`op_held`: a ring's record, nothing to wait for; left unread, the acks, which count in order, would
        hold every other thread's replies until this thread's next op)."""
        pending = getattr(self._local, "pending", None)
        if not pending:
            return []
        last_seq, last_call = pending[-1][1], pending[-1][2]
        keep = [] if last_seq <= upto or getattr(last_call, "op_held", False) else pending[-1:]
        self._local.pending = keep
        return pending[:len(pending) - len(keep)]

    def drop(self, backup: str) -> None:
        """Close this thread's connection to the lost `backup` (dropped unclosed, its sockets would linger)."""
        send = self._mine().channels.pop(backup, None)
        close = getattr(send, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # closing a connection to a task that is gone: nothing left to save
                pass
