"""A served part's replication, wired to this process: which backup its ops go to, by which path, and what
a fenced primary does.

`replicator.py` is the protocol with its connections injected; this module injects this ps task's:
remote calls through `cluster/calls/endpoint.py`, a same-host link and ring for a link thread's pushes
(`mirror_link.py`), the store's compare-and-set for the "goes on alone" mark. A part is fed from the task
that serves it: its own primary, or the backup serving it while promoted (`endpoints.promote`), whose ops
then go on to the next ps task round the ring.
"""

from __future__ import annotations

import os
from typing import Optional

from towerflow import _log
from towerflow.cluster import server as _server
from towerflow.cluster.link import shm_link as _shm_link
from towerflow.cluster.calls import endpoint as _calls
from towerflow.errors import ConnectionLost
from towerflow.ps.messages import Endpoints
from towerflow.ps.replication_messages import PROMOTED, ReplicaFrame, move_key, unreplicated_key
from towerflow.ps.server.replication import mirror_link as _mirror_link
from towerflow.ps.server.replication import snapshot as _snapshot
from towerflow.ps.server.replication.replicator import Replicator
from towerflow.ps.server.service import ShardService

FENCED_EXIT = 75  # a primary that learns its backup was promoted in its place stops with this status


def replicate(model: str, task: int, service: ShardService, backup_task: int, reseed: bool, max_lag: int = 0,
              serving: Optional[int] = None, own_push: bool = False) -> None:
    """Make `service` (ps task `task`'s part, served here under `model`) forward its calls to the mirror on ps
    task `backup_task` (seeded now, and again after its state was replaced by a snapshot); `max_lag` > 0:
    replies run up to that many ops ahead of its acks; `own_push`: a reply waits for the push it answers (workers
    that prefetch); `serving`: the task that serves the part, when it is not `task` itself (a promoted backup)."""
    server = _server.current()
    serving = task if serving is None else serving
    replica = service.replica
    if not isinstance(replica, Replicator):
        sender = server.call_name_of("ps", serving)
        replica = Replicator(
            model, task, sender, backup_task, service._lock,
            lambda: _snapshot.take(service),
            lambda to, frame: _calls.call_async(to, Endpoints.replicate, args=(frame,)),
            lambda error: isinstance(error, ConnectionLost),
            lambda backup, lost, cause: server.wait_for_restart("ps", backup, lost, cause, alive_ok=True),
            direct=_direct_sender(server, model, task, serving, backup_task, service, sender), max_lag=max_lag,
            own_push=own_push,
            mark_unreplicated=lambda on: move_key(server.swap, unreplicated_key(model, sender), "1" if on else "0",
                                                  ("", "0") if on else ("1",)) != PROMOTED,
            reconnect=_calls.reconnect, fenced=lambda why: _fence(server.name, why))
        service.replica = replica
    elif not reseed:
        return
    replica.seed(server.call_name_of("ps", backup_task))


def _fence(name: str, why: str) -> None:
    """This primary may answer no worker again (replicator.py): stop; the launcher restarts it, and the chief
    restores the new incarnation from the part its backup served meanwhile."""
    _log.get("ps", name).warning(f"stopping without answering any worker again: {why}")
    os._exit(FENCED_EXIT)


def _direct_sender(server, model: str, task: int, serving: int, backup_task: int, service: ShardService, sender: str):
    """What opens a thread's own connection to the backup `to` (a same-host link's thread: a shared-memory link
    for its pushes, `mirror_link.py`, beside a direct channel), or None on the messaging thread, which must not
    wait for an ack."""
    same_host = _shm_link.same_host(server.cluster.task_address("ps", serving),
                                    server.cluster.task_address("ps", backup_task))
    use_link = same_host and server.context.ps.link != "zmq"

    def open_for(to: str):
        if _calls.on_socket_thread():
            return None
        other = _ToBackup(_calls.direct_channel(to))
        if not use_link:
            return other
        offer = lambda link, ring: _calls.call_async(  # noqa: E731
            to, Endpoints.attach_mirror_link, args=(model, task, link, ring, sender)).wait()
        return _mirror_link.open_sender(service.flats, offer, other, server.name) or other

    return open_for


class _ToBackup:
    """A thread's own direct channel to the backup, sending ops as `replicate` calls; closed once it is lost."""

    def __init__(self, channel):
        self.channel = channel

    def __call__(self, frame: ReplicaFrame):
        return self.channel.call(Endpoints.replicate, frame)

    def close(self) -> None:
        self.channel.close()
