"""The worker's side of a ps step over a same-host link (`cluster/link/shm_link.py`) instead of a remote call.

A worker and a ps task on one host exchange each step's gradients and values through
shared tensors: the worker packs its gradients straight into the link's request slot
(the channel's push buffers are those tensors) and reads the values from the reply slot;
the ps side (`server/linked.py`) runs the very same `ShardService.push_pull` as for a remote
call. Dense variables only: a step that carries table rows goes over remote calls.

When a link is tried (`wanted`): both tasks' addresses in the cluster name the same host and
TOWERFLOW_PS_LINK is not "zmq". A ps task that cannot open the worker's files (another
host after all) declines, and the channel keeps remote calls.
"""

from __future__ import annotations

from typing import Callable, Optional

from towerflow import _log
from towerflow.cluster.link import shm_link
from towerflow.ps.messages import PushPull, PushPulled


def wanted(cluster, worker_task: tuple, ps_task: int, ps_link: str) -> bool:
    """Whether this worker should offer the ps task a shared-memory link (`ps_link`: the task's setting)."""
    if ps_link == "zmq":
        return False
    try:
        return shm_link.same_host(cluster.task_address(*worker_task), cluster.task_address("ps", ps_task))
    except Exception:  # a task without an address (not in the spec): no link
        return False


def offer_for(ch, who: str) -> Optional[shm_link.LinkClient]:
    """A link whose request and reply slots have the shapes of the channel's flat buffers (one per dtype), or
    None, said on stderr, when shared memory cannot hold them (the steps then go over remote calls)."""
    specs = tuple((b.numel(), b.dtype) for b in ch.buffers[0])
    try:
        return shm_link.LinkClient(specs, specs)
    except OSError as e:
        need = 2 * shm_link.SLOTS * sum(b.numel() * b.element_size() for b in ch.buffers[0])
        _log.get("ps", who).warning(
            f"no shared-memory link to /job:ps/task:{ch.task} ({e}; it needs {need / 2**20:.0f} MiB in "
            f"{shm_link.SHM_DIR}): its steps go over remote calls. Give {shm_link.SHM_DIR} more room (docker run "
            "--shm-size, a pod's emptyDir medium Memory) or set TOWERFLOW_PS_LINK=zmq to silence this.")
        return None


class LinkedStep:
    """A step sent over a link, its reply not read yet: what a remote call's future is (`PSClient.wait` reads it)."""

    def __init__(self, link: shm_link.LinkClient, slot: int):
        self.link, self.slot = link, slot

    def result(self, idle: Optional[Callable[[], None]] = None) -> PushPulled:
        """The `PushPulled` whose values are the slot's reply tensors (valid until the slot is used again, two
        steps later); `idle()` runs every second while the ps has not answered."""
        return PushPulled.from_flat((*self.link.reply(self.slot, idle), *self.link.replies[self.slot]))


def push_pull(link: shm_link.LinkClient, slot: int, request: PushPull) -> LinkedStep:
    """Send the step whose gradients are already in `slot`'s request tensors: its plain values go down the pipe
    as a tuple (`PushPull.header`), the gradients stay where they are."""
    link.call(slot, request.header())
    return LinkedStep(link, slot)


def close(link: Optional[shm_link.LinkClient]) -> None:
    if link is not None:
        link.close()
