"""A backup ps task's side of replication: one mirror of a primary's part of a model, fed in order.

The primary (`replicator.py`) sends a seed (a `ServiceSnapshot`), then every state-changing call it
makes, numbered, by remote calls or, on one host, through shared memory (`mirror_link.py`): there its
pushes wait in rings that this mirror takes from whenever another op arrives or its state is read. The
mirror is a `ShardService` of its own that nobody pulls from. It holds each frame until the ones
before it have come (an early one waits; one already held, or from an incarnation that no longer
feeds the mirror, is ignored), applies the ops strictly in their numbers' order, and answers each
frame with the last number it holds in order: the primary's acknowledgement. Holding is what the
primary needs; applying can wait. So the ops stay queued, unapplied, up to `MIRROR_HOLD_BYTES` of their
tensors: a primary whose whole state is small sends a fresh seed every so often
(`fresh_seeds.FreshSeeds`), which makes the ops queued before it moot, and a backup then never runs the
primary's optimizer at all. Past the bound, or when the state is asked for (a restore, a promotion),
the thread that finds them applies the queued ops, unless another thread is applying already (then it
leaves them to that one): no thread of its own, so no wake-up per op.

Promoted (`promote`), the mirror's service serves the lost primary's part itself, and the mirror refuses
every later op of that incarnation: one cut off but alive learns that it was replaced (its replication
marks the store, finds the promotion and stops) instead of forking the part. The chief's read of the
state (`retire`), or a new incarnation's seed, ends it. A mirror fed by a promoted backup is dropped once that
backup gives the part back (`drop`).
"""

from __future__ import annotations

import collections
import threading
from typing import Deque, Dict, List, Optional, Tuple

import torch

from towerflow.cluster.link.shm_ring import RingReader
from towerflow.errors import ParameterServerError
from towerflow.ps.replication_messages import (MIRROR_HOLD_BYTES, DropOp, FinishOp, LoadStateOp, MirrorState, PushOp,
                                               RejoinOp, ReplicaFrame, ReplicaOp, RowsReadOp, SeedOp, op_nbytes)
from towerflow.ps.server.replication import snapshot as _snapshot
from towerflow.ps.server.replication.mirror_link import push_frame
from towerflow.ps.server.service import ShardService

class Mirror:
    """The backup's copy of one primary's part of a model."""

    def __init__(self, model: str, primary: int):
        self.model, self.primary = model, primary
        self.service: Optional[ShardService] = None
        self.fed_by: Optional[str] = None  # the primary incarnation whose seed this mirror holds
        self.seq = 0  # the number of the last op held in order (what the ack says)
        self.applied = 0  # the number of the last op applied
        self._taken = 0  # the number of the last op taken from the queue to apply (applied, or being applied)
        self.error: Optional[BaseException] = None  # an op failed to apply: the mirror is no longer equal
        self._early: Dict[int, ReplicaFrame] = {}  # frames that came before their predecessors
        self._queue: Deque[Tuple[int, ReplicaOp]] = collections.deque()  # held in order, not applied yet
        self._queued_bytes = 0  # their tensors' bytes
        self._applying = False
        self.promoted = False  # its service serves the lost primary's part (endpoints.promote), until retired
        self._rings: List[Tuple[str, RingReader]] = []  # (the primary incarnation writing it, its ring)
        self._lock = threading.Condition()

    def add_ring(self, sender: str, ring: RingReader) -> None:
        """Take `sender`'s pushes from `ring` too (`mirror_link.py`)."""
        with self._lock:
            self._rings.append((sender, ring))

    def drop_ring(self, ring: RingReader) -> None:
        """Its writer is gone: keep what it wrote (the state may be asked for next), then let it go."""
        with self._lock:
            self._hold_what_came()
            self._rings = [(s, r) for s, r in self._rings if r is not ring]

    def _take_rings(self) -> None:
        """Hold, as early frames, the ops the feeding incarnation wrote into its rings; those a seed made moot are
        skipped without a copy."""
        for sender, ring in self._rings:
            if sender == self.fed_by and not self.promoted:
                ring.take(lambda values, grads, sender=sender: self._hold_record(sender, values, grads))

    def _hold_record(self, sender: str, values: tuple, grads: List[torch.Tensor]) -> None:
        if int(values[0]) > self.seq:
            frame = push_frame(self.model, self.primary, sender, values, grads)
            self._early[frame.seq] = frame

    def _close_rings(self, keep: Optional[str]) -> None:
        """Tell the writers of every ring not written by `keep` that this mirror takes no more from them."""
        for sender, ring in self._rings:
            if sender != keep:
                ring.close()
        self._rings = [(s, r) for s, r in self._rings if s == keep]

    def _hold_what_came(self) -> None:
        """Take the rings' records, then hold in order every op whose predecessors are all here (under the lock)."""
        self._take_rings()
        while self.fed_by is not None and self.seq + 1 in self._early:
            self.seq += 1
            op = self._early.pop(self.seq).op
            self._queue.append((self.seq, op))
            self._queued_bytes += op_nbytes(op)

    def receive(self, frame: ReplicaFrame) -> torch.futures.Future:
        """Hold `frame`, apply what is ready (unless another thread does), and answer with a future of the last
        number held in order."""
        future: torch.futures.Future = torch.futures.Future()
        if isinstance(frame.op, DropOp):  # its feeder gave the part back: nothing this mirror holds is wanted
            self.drop(frame.sender)
            future.set_result(frame.seq)
            return future
        with self._lock:
            if self.promoted and (not isinstance(frame.op, SeedOp) or frame.sender == self.fed_by):
                future.set_exception(ParameterServerError(
                    f"the backup of /job:ps/task:{self.primary}'s part of {self.model!r} was promoted in place of "
                    f"{self.fed_by}: it takes no more ops from {frame.sender}"))
                return future
            if isinstance(frame.op, SeedOp) and frame.op.refresh:
                if frame.sender == self.fed_by:
                    self._refresh(frame)
            elif isinstance(frame.op, SeedOp):
                self.promoted = False
                self.fed_by, self.seq, self._taken = frame.sender, frame.seq, 0
                self._early = {s: f for s, f in self._early.items() if f.sender == frame.sender and s > frame.seq}
                self._queue.clear()  # what the seed replaces is not applied (a thread applying holds only its op)
                self._queued_bytes = 0
                self._queue.append((frame.seq, frame.op))
                self._close_rings(keep=frame.sender)
            elif frame.sender == self.fed_by and frame.seq <= self.seq:
                pass  # held already
            elif self.fed_by is None or frame.sender == self.fed_by:
                self._early[frame.seq] = frame
            # else: a frame of an incarnation that no longer feeds this mirror (it was seeded anew since)
            self._hold_what_came()
            held = self.seq
            applies = self._queued_bytes > MIRROR_HOLD_BYTES and not self._applying
            self._applying = self._applying or applies
        if applies:
            self._apply_queued()
        if self.error is not None:
            future.set_exception(self.error)
        else:
            future.set_result(held)
        return future

    def _refresh(self, frame: ReplicaFrame) -> None:
        """The feeder's state after op `frame.seq` (under the lock): it replaces the ops held up to there, unapplied,
        and the ops after it stay held; ignored once an op after it is applied or being applied (it would undo it)."""
        if frame.seq < self._taken:
            return
        self.seq = max(self.seq, frame.seq)
        self._early = {s: f for s, f in self._early.items() if s > frame.seq}
        later = [(s, op) for s, op in self._queue if s > frame.seq]
        self._queue = collections.deque([(frame.seq, frame.op), *later])
        self._queued_bytes = sum(op_nbytes(op) for _, op in self._queue)

    def _apply_queued(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._applying = False
                    self._lock.notify_all()
                    return
                seq, op = self._queue.popleft()
                self._taken = seq
                self._queued_bytes -= op_nbytes(op)
            try:
                if isinstance(op, SeedOp):
                    self.service, self.error = _snapshot.build(op.snapshot), None
                elif self.error is None:
                    apply(self.service, op)
            except Exception as e:  # the primary learns it from the ack and goes on unreplicated
                self.error = ParameterServerError(f"the mirror of /job:ps/task:{self.primary}'s part of {self.model!r} "
                                                  f"could not apply op {seq} ({type(op).__name__}): {e}")
            self.applied = seq

    def wait_applied(self, timeout: float = 60.0) -> None:
        """Apply every op held so far, or wait while another thread does (ParameterServerError after `timeout` s)."""
        with self._lock:
            self._hold_what_came()
            mine = bool(self._queue) and not self._applying
            self._applying = self._applying or mine
        if mine:
            self._apply_queued()
        with self._lock:
            if not self._lock.wait_for(lambda: not self._queue and not self._applying, timeout):
                raise ParameterServerError(f"the mirror of /job:ps/task:{self.primary}'s part of {self.model!r} did not "
                                           f"apply its {len(self._queue)} held ops within {timeout:g} s")

    def promote(self, lost: str) -> Optional[ShardService]:
        """Take no more ops and hand over the service, every op held applied, to serve in place of the primary
        incarnation `lost`; None when the mirror does not stand for it (fed by another, never seeded, or an op
        failed to apply)."""
        with self._lock:
            if not self.promoted and (self.fed_by != lost or self.error is not None):
                return None
            self._hold_what_came()  # what the lost primary wrote before, and never again what it may write after
            self.promoted = True
            self._close_rings(keep=None)
        self.wait_applied()  # the seed and every op it holds, applied
        return self.service if self.error is None else None

    def stands_in_for(self, sender: str) -> bool:
        """Whether this mirror serves in place of incarnation `sender`: a seed from it is stale (sent before it was
        lost, or by a process that was only frozen), not a new primary taking the part back."""
        with self._lock:
            return self.promoted and sender == self.fed_by

    def drop(self, sender: str) -> bool:
        """Let go of the state and the rings: `sender`, which fed this mirror, serves the part no more (it gave it
        back to its primary); False, keeping everything, when another incarnation feeds it or it serves the part."""
        with self._lock:
            if self.promoted or sender != self.fed_by:
                return False
            rings = [ring for _, ring in self._rings]
            self._close_rings(keep=None)
            self.service, self.error = None, None
            self._early.clear()
            self._queue.clear()
            self._queued_bytes = 0
        for ring in rings:
            ring.let_go()
        return True

    def retire(self) -> bool:
        """Stop serving in the primary's place (the chief takes the part back); whether it was promoted."""
        with self._lock:
            was, self.promoted = self.promoted, False
        return was

    def state(self) -> MirrorState:
        """The mirror's whole state once every held op is applied, with who fed it and how far (snapshot None:
        never seeded, or an op failed to apply)."""
        self.wait_applied()
        with self._lock:
            if self.service is None or self.error is not None:
                return MirrorState(None, self.fed_by, self.seq)
            with self.service._lock:
                return MirrorState(_snapshot.take(self.service), self.fed_by, self.seq)

    def metrics(self) -> dict:
        with self._lock:
            return {"primary": self.primary, "fed_by": self.fed_by, "promoted": self.promoted, "held": self.seq, "applied": self.applied,
                    "queued": len(self._queue), "early": len(self._early), "rings": len(self._rings), "error": str(self.error or "") or None,
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
