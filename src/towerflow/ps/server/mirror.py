"""A backup ps task's side of replication: one mirror of a primary's part of a model, fed in order.

The primary (`replication.py`) sends a seed (a `ServiceSnapshot`), then every state-changing call it
makes, numbered. The mirror is a `ShardService` of its own that nobody pulls from: it applies the
ops strictly in their numbers' order (an early one waits for the ones before it; one already applied,
or from an incarnation that no longer feeds it, is ignored) and answers each frame with the last
number it applied, which is the primary's acknowledgement. The chief reads it back whole
(`state`) when the primary is lost.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional

from towerflow.errors import ParameterServerError
from towerflow.ps.replication_messages import (FinishOp, LoadStateOp, MirrorState, PushOp, RejoinOp, ReplicaFrame,
                                               ReplicaOp, RowsReadOp, SeedOp)
from towerflow.ps.server import snapshot as _snapshot
from towerflow.ps.server.service import ShardService


class Mirror:
    """The backup's copy of one primary's part of a model."""

    def __init__(self, model: str, primary: int):
        self.model, self.primary = model, primary
        self.service: Optional[ShardService] = None
        self.fed_by: Optional[str] = None  # the primary incarnation whose seed this mirror holds
        self.seq = 0  # the number of the last op applied
        self.applied = 0
        self._early: Dict[int, ReplicaFrame] = {}  # frames that came before their predecessors
        self._lock = threading.Lock()

    def receive(self, frame: ReplicaFrame) -> int:
        """Apply `frame` and whatever it makes ready, in order; the last number applied."""
        with self._lock:
            if isinstance(frame.op, SeedOp):
                self.service = _snapshot.build(frame.op.snapshot)
                self.fed_by, self.seq = frame.sender, frame.seq
                self._early = {s: f for s, f in self._early.items() if f.sender == frame.sender and s > frame.seq}
            elif frame.sender == self.fed_by and frame.seq <= self.seq:
                return self.seq  # applied already
            elif self.fed_by is None or frame.sender == self.fed_by:
                self._early[frame.seq] = frame
            # else: a frame of an incarnation that no longer feeds this mirror (it was seeded anew since)
            while self.service is not None and self.seq + 1 in self._early:
                apply(self.service, self._early.pop(self.seq + 1).op)
                self.seq += 1
                self.applied += 1
            return self.seq

    def state(self) -> MirrorState:
        """The mirror's whole state now, with who fed it and how far (snapshot None: never seeded)."""
        with self._lock:
            if self.service is None:
                return MirrorState(None, None, 0)
            with self.service._lock:
                return MirrorState(_snapshot.take(self.service), self.fed_by, self.seq)

    def metrics(self) -> dict:
        with self._lock:
            return {"primary": self.primary, "fed_by": self.fed_by, "seq": self.seq, "applied": self.applied,
                    "early": len(self._early),
                    "global_step": self.service.coordinator.global_step if self.service is not None else None}


def apply(service: ShardService, op: ReplicaOp) -> None:
    """What the primary did, done again here (the service's own checks passed there, so they pass here)."""
    if isinstance(op, PushOp):
        service.push(op.worker, op.ticket, op.grads, op.lr, op.rows, op.kind)
    elif isinstance(op, FinishOp):
        service.finish(op.worker)
    elif isinstance(op, RejoinOp):
        service.rejoin(op.worker, restarted=True)
    elif isinstance(op, LoadStateOp):
        service.load_state_dict(op.state, op.finished)
    elif isinstance(op, RowsReadOp):
        service.read_rows(op.request)
    else:
        raise ParameterServerError(f"internal: a mirror cannot apply {type(op).__name__}")
