"""A worker's training step against the ps tasks: push its gradients, pull the new values, install them.

Each ps task gets one push-pull call per step, all in flight at once. How a call travels is chosen
once per ps incarnation behind `send`: a same-host shared-memory link (`linked.py`) when one was
accepted, else this thread's direct ZeroMQ channel, the dense values laid out flat (`PushPull.flat`) or,
with table rows, as a message; every way answers with a `PushPulled`. With prefetch, a step installs
the values the previous one fetched, so they travel while the worker computes.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

import torch

from towerflow.cluster.calls import endpoint as _calls
from towerflow.ps.messages import Endpoints, PolicySpec, Pulled, PushPull, PushPulled
from towerflow.ps.worker import linked
from towerflow.ps.worker.calls import PSCalls, lost_as_ps_task_lost
from towerflow.ps.worker.channel import Channel
from towerflow.ps.worker.counters import StepCounters


class _FlatStep:
    """A dense step sent as plain values (`PushPull.flat`) on a direct channel: its reply read as a `PushPulled`."""

    def __init__(self, call):
        self.call = call

    def result(self, idle: Optional[Callable[[], None]] = None) -> PushPulled:
        return PushPulled.from_flat(self.call.result(idle))


class Stepper:
    """This worker's steps: its clock (`pushes`), the values fetched ahead (prefetch), and how each step travels."""

    def __init__(self, calls: PSCalls, counters: StepCounters, worker: int, device: torch.device, policy: PolicySpec,
                 prefetch: bool):
        self.calls, self.counters = calls, counters
        self.worker, self.device, self.policy, self.prefetch = worker, device, policy, prefetch
        self.pushes = 0  # this worker's clock: pushes sent (and, after a loss, kept by the ps)
        self.links = True  # same-host links may carry the steps (not with table rows, which travel as messages)
        self.pending: Optional[List[Any]] = None  # prefetch: the push-pulls of the last step, not installed yet

    def send(self, ch: Channel, slot: int, request: PushPull):
        """The step's call to one ps task, over its link or this thread's direct channel: what `wait` reads a
        `PushPulled` from. Kept in `ch.sent` to be sent again when the ps is lost and its mirror lacks it."""
        ch.sent.append((slot, request))
        with lost_as_ps_task_lost(ch):
            if ch.link is not None and request.rows is None:
                return linked.push_pull(ch.link, slot, request)
            if ch.direct is None:
                ch.direct = _calls.direct_channel(ch.via or ch.to)
            key = ch.key or self.calls.model_name
            if request.rows is None:
                return _FlatStep(ch.direct.call(Endpoints.push_pull_flat, key, *request.flat()))
            return ch.direct.call(Endpoints.push_pull, key, request)

    def _try_link(self, ch: Channel) -> None:
        """Once per ps incarnation: offer a ps task of this host a shared-memory link for the steps (`linked.py`)."""
        if ch.link_tried_for == ch.to or not self.links or ch.via is not None:
            return
        ch.link_tried_for = ch.to
        server = self.calls.server
        if not linked.wanted(server.cluster, (server.job_name, server.task_index), ch.task, server.context.ps.link):
            return
        link = linked.offer_for(ch, server.name)
        if link is None:
            return
        try:
            accepted = self.calls.wait(ch, self.calls.call(ch, Endpoints.attach_link, self.worker, link.offer))
            if accepted:
                link.connect()
                ch.use_link(link)
        finally:
            if ch.link is not link:
                link.close()

    def pull(self) -> List[Any]:
        """Futures of every ps task's values for this worker's next step (its clock at each ps task)."""
        return [self.calls.call(ch, Endpoints.pull, self.worker, ch.pushes) for ch in self.calls.channels]

    def install(self, futures: List[Any]) -> int:
        """Wait for pulls (or push-pulls), copy their values into the model; the ps's global step they are of."""
        t0 = time.perf_counter()
        for ch, f in zip(self.calls.channels, futures):
            reply = self.calls.wait(ch, f)
            if isinstance(reply, PushPulled):
                self.counters.replied(reply.outcome)
                reply = reply.pulled
            pulled: Pulled = reply
            ch.install(pulled.ticket, pulled.values, self.device)
            self.counters.pulled(ch.task, ch.nbytes)
        self.counters.waited(time.perf_counter() - t0)
        return self.calls.channels[0].ticket.step if self.calls.channels else 0

    def push_pull(self, lr: Optional[float], rows: Dict[int, Any], kind: str) -> Optional[int]:
        """One step: a push-pull per ps task carrying its dense gradients (or, `kind="delta"`, a local-steps
        worker's deltas) and its part of the table rows (`rows` by task); the global step of the values
        installed, or None when prefetch installed none (its first step)."""
        k = self.pushes % 2  # push buffer set k was last used two steps ago, and that call has been waited for
        self.pushes += 1
        calls = []
        for ch in self.calls.channels:
            self._try_link(ch)
            ch.pushes += 1
            clock = ch.pushes + (1 if self.prefetch else 0)  # the step the returned values will compute
            after = ch.ticket.step + 1 if self.policy.mode == "sync" else 0  # sync: come back after the aggregated update
            part = rows.get(ch.task)
            calls.append(self.send(ch, k, PushPull(self.worker, ch.ticket, ch.gather(k), lr, clock, after, part, kind)))
            self.counters.pushed(ch.task, ch.nbytes + (part.nbytes if part is not None else 0))
        if not self.prefetch:
            return self.install(calls)
        if self.pending is None:  # first step: nothing fetched ahead yet; compute once more on these values
            self.pending = calls
            return None
        previous, self.pending = self.pending, calls
        return self.install(previous)

    def install_pending(self) -> Optional[int]:
        """Install what was fetched ahead (at the end: its pushes count, and the model ends with the latest values)."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        return self.install(pending)
