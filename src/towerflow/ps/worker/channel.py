"""A ps worker's link to one ps task: which parameter pieces go there, the reused push buffers, and
how pulled values go back into the model. Kept apart from `client.py` (the calls) so that
tests/ps/test_worker_channel.py checks the packing without processes."""

from __future__ import annotations

import collections
from typing import Deque, Dict, List, Optional

import torch

from towerflow.cluster.calls.names import call_name
from towerflow.ps.layout import Layout
from towerflow.ps.messages import Ticket


class Channel:
    """This worker's link to one ps task: which parameter pieces go there, reused push buffers, its ticket."""

    def __init__(self, task: int, layout: Layout, params: Dict[str, torch.nn.Parameter], device: torch.device,
                 to: Optional[str] = None):
        self.task = task
        self.to = to or call_name("ps", task)  # the ps task's call name (its current incarnation's)
        self.via: Optional[str] = None  # while its backup serves this part (promoted): the backup's call name
        self.key: Optional[str] = None  # ... and the name the part has there (replication_messages.part_key)
        self.shards = layout.on_task(task)
        sizes = layout.flat_sizes(task)
        self.dtypes = list(sizes)
        pin = device.type == "cuda"
        # two sets of push buffers: one may still be on the wire while the other is filled
        self.buffers = [[torch.empty(sizes[d], dtype=d, pin_memory=pin) for d in self.dtypes] for _ in range(2)]
        self.staging = [torch.empty(sizes[d], dtype=d, device=device) for d in self.dtypes] if pin else None
        self.params = [params[s.variable] for s in self.shards]
        self.ticket = Ticket(0)
        self.pushes = 0  # this worker's pushes this ps task has counted (its clock there)
        self.nbytes = sum(b.numel() * b.element_size() for b in self.buffers[0])
        self.link = None  # a same-host shared-memory link to the ps task (`linked.py`), when it has one
        self.direct = None  # else this worker's own connection for its steps (cluster/calls/direct.py), opened on the first
        self._views: List[tuple] = []  # (a reply slot's tensors, the parameters' views into them), per slot
        self.link_tried_for: Optional[str] = None  # the ps incarnation (call name) a link was last offered to
        # (push buffer set, PushPull) of the last two steps sent here: a ps restored from its mirror may lack
        # them (ps/server/replication/replicator.py), and their buffers are not reused before the step after
        self.sent: Deque[tuple] = collections.deque(maxlen=2)

    def use_link(self, link) -> None:
        """Steps go over `link` from now on: its request slots become the push buffers (packing writes into them)."""
        self.link = link
        self.buffers = link.requests
        if not any(s.is_partitioned for s in self.shards):  # whole variables: install re-points them (on the CPU)
            self._views = [(slot, self._views_of(slot)) for slot in link.replies]

    def _views_of(self, flats: List[torch.Tensor]) -> List[torch.Tensor]:
        by_dtype = dict(zip(self.dtypes, flats))
        return [by_dtype[s.dtype][s.offset:s.offset + s.numel].view(s.shape) for s in self.shards]

    def _slot_views(self, flats: List[torch.Tensor]) -> List[torch.Tensor]:
        """The parameters' views into a link's reply slot, cut once per slot (a step re-points, not re-slices)."""
        for slot, views in self._views:
            if all(a is b for a, b in zip(slot, flats)):
                return views
        return self._views_of(flats)  # the values came over remote calls (the first pull, a refresh)

    def serve_from(self, via: Optional[str], key: Optional[str]) -> None:
        """Call the part at `via` under `key` from now on (its promoted backup; None, None: its ps task again)."""
        self.drop_link()
        self.via, self.key = via, key

    def drop_link(self) -> None:
        """The ps task was lost: close the link and the direct channel (their pending steps fail); the next step
        offers a new link, or opens a new channel, to its next incarnation."""
        if self.link is not None:
            self.link.close()
        if self.direct is not None:
            self.direct.close()
        self.link = self.direct = None
        self._views = []
        self.link_tried_for = None

    def _piece(self, s, t: torch.Tensor) -> torch.Tensor:
        return t[s.row_start:s.row_stop] if s.is_partitioned else t

    def gather(self, k: int) -> List[torch.Tensor]:
        """Pack this task's gradient pieces into push buffer set k (one cat per dtype)."""
        out = []
        for i, d in enumerate(self.dtypes):
            srcs = []
            for s, p in zip(self.shards, self.params):
                if s.dtype == d:
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    srcs.append(self._piece(s, g).reshape(-1))
            if self.staging is None:
                torch.cat(srcs, out=self.buffers[k][i])
            else:
                torch.cat(srcs, out=self.staging[i])
                self.buffers[k][i].copy_(self.staging[i])
            out.append(self.buffers[k][i])
        return out

    @torch.no_grad()
    def install(self, ticket: Ticket, flats: List[torch.Tensor], device: torch.device) -> None:
        """Put pulled values into the model's parameters.

        On the CPU a whole (unpartitioned) variable is re-pointed at its slice of the received
        buffer, which the transport allocated for this pull anyway: no copy. Row shards, and
        every variable on a GPU, are copied (one foreach copy per call).
        """
        self.ticket = ticket
        if self._views and device.type == "cpu":
            for p, view in zip(self.params, self._slot_views(flats)):
                p.data = view
            return
        by_dtype = dict(zip(self.dtypes, flats))
        if device.type != "cpu":
            by_dtype = {d: f.to(device, non_blocking=True) for d, f in by_dtype.items()}
        dsts, srcs = [], []
        for s, p in zip(self.shards, self.params):
            src = by_dtype[s.dtype][s.offset:s.offset + s.numel].view(s.shape)
            if device.type == "cpu" and not s.is_partitioned:
                p.data = src
            else:
                dsts.append(self._piece(s, p.data))
                srcs.append(src)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
