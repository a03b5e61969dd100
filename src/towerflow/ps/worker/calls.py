"""A worker's calls to the ps tasks of one model: one `Channel` per ps task, the waits, and what a loss raises.

Every call and wait to a ps task that is gone (its connection lost, or its part moved to its backup)
raises `PSTaskLost`, naming the part and the incarnation that served it; what to do then is
`recovery.py`'s job. A wait also watches the other tasks' heartbeats and the ps tasks' restarts, since
a reply that never comes is how a ps cut off by the network looks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List

import torch

from towerflow.cluster.calls import endpoint as _calls
from towerflow.cluster.calls.names import lost_task
from towerflow.cluster.membership import membership as _membership
from towerflow.errors import ConnectionLost, PSTaskLost
from towerflow.ps.messages import Endpoint, PartMoved
from towerflow.ps.worker.channel import Channel


def ps_task_lost(part: int, name: str, reason: str) -> PSTaskLost:
    """The error of a call to a ps task that is gone (`Recovery.guarded` catches it and recovers): the part of ps
    task `part`, served by the incarnation called `name` (the part's own, or its promoted backup)."""
    task, incarnation = lost_task(name)
    return PSTaskLost(part, name, reason, task, incarnation)


@contextlib.contextmanager
def lost_as_ps_task_lost(ch: Channel) -> Iterator[None]:
    """A call, send or wait that failed because the channel's ps task is gone raises PSTaskLost (the rest as is)."""
    try:
        yield
    except PartMoved as e:
        raise ps_task_lost(ch.task, ch.to, str(e)) from e
    except ConnectionLost as e:  # the task lost: the part's own, or its promoted backup
        raise ps_task_lost(ch.task, ch.via or ch.to, str(e)) from e


class PSCalls:
    """Calls to every ps task holding part of model `model_name`, through `channels` (set by the client's attach)."""

    def __init__(self, server, model_name: str):
        self.server = server
        self.model_name = model_name
        self.channels: List[Channel] = []

    def call(self, ch: Channel, fn: Endpoint, *args: Any):
        """fn(model, *args) on the channel's ps task, a future; a gone ps raises PSTaskLost."""
        with lost_as_ps_task_lost(ch):
            return _calls.call_async(ch.via or ch.to, fn, args=(ch.key or self.model_name, *args))

    def wait(self, ch: Channel, future) -> Any:
        """The call's reply. A ps cut off by the network never fails the call, and a sync or ssp pull also
        waits on other workers: the wait watches their heartbeats, and the ps tasks' restarts, to say when
        to stop waiting."""
        watch = self.watch()
        with lost_as_ps_task_lost(ch):
            if not isinstance(future, torch.futures.Future):  # a link's or direct channel's step: read in this thread
                return future.result(idle=watch)
            _membership.wait_for(future, watch)
            return future.wait()

    def watch(self) -> Callable[[], None]:
        """A check for a wait on the ps: raises PeerLost for a task that failed or went silent, and PSTaskLost
        for a ps task restarted since this worker last called it. A sync round waits on ps task 0 for a worker
        that is itself waiting for the chief to restore ps task 1: the chief has to learn of that restart even
        when none of its own calls saw the loss."""
        peers = self.server.peer_watch(serving=("ps",))

        def check() -> None:
            peers()
            for ch in self.channels:
                now = self.server.call_name_of("ps", ch.task)
                if now != ch.to:
                    raise ps_task_lost(ch.task, ch.to, f"it was restarted (now {now})")
        return check

    def on_all(self, fn: Endpoint, *args: Any) -> List[Any]:
        """fn(model, *args) on every ps task at once; their replies in channel order."""
        calls = [(ch, self.call(ch, fn, *args)) for ch in self.channels]
        return [self.wait(ch, f) for ch, f in calls]

    def on_each(self, fn: Endpoint, args_of: Callable[[Channel], tuple]) -> List[Any]:
        """fn(model, *args_of(ch)) on every ps task at once; their replies in channel order."""
        calls = [(ch, self.call(ch, fn, *args_of(ch))) for ch in self.channels]
        return [self.wait(ch, f) for ch, f in calls]

    def follow_restarts(self) -> None:
        """After a ps task was restarted: call each ps task's current incarnation."""
        for ch in self.channels:
            now = self.server.call_name_of("ps", ch.task)
            if now != ch.to or ch.via is None:  # a part its backup serves stays there until the task is back
                ch.to = now
                ch.serve_from(None, None)  # the next step offers the new incarnation a link
