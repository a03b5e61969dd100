"""The ps side of a step over a same-host link (`cluster/link/shm_link.py`): the handler that serves it.

The worker (`worker/linked.py`) has put its gradients in a request slot; the handler runs the
very same `ShardService.push_pull` as for a remote call, with the slot as the gradients, and
copies the values it would have sent into the reply slot. The ps stays the owner; the modes
keep their semantics because the same coordinator decides.
"""

from __future__ import annotations

from typing import Callable, List

import torch

from towerflow.cluster.link import shm_link
from towerflow.ps.messages import PushPull, PushPulled


def mapped(future: torch.futures.Future, fn: Callable) -> torch.futures.Future:
    """A future of fn(future's value), failing with the very exception `future` fails with (`.then` would wrap
    it in a plain RuntimeError, and the worker could no longer tell what failed)."""
    out: torch.futures.Future = torch.futures.Future()

    def done(f: torch.futures.Future) -> None:
        try:
            out.set_result(fn(f.value()))
        except Exception as e:
            out.set_exception(e)

    future.add_done_callback(done)
    return out


def handler(service_of: Callable[[], object]) -> shm_link.Handler:
    """The ps side: run `push_pull` of the current service with the slot's gradients, reply with the values copied."""

    def handle(header: tuple, grads: List[torch.Tensor], reply: List[torch.Tensor]) -> torch.futures.Future:
        future = service_of().push_pull(PushPull.from_flat((*header, *grads)))
        if future.done():  # answered now (async): reply without a callback chain
            return _into(future.value(), reply)
        return mapped(future, lambda result: _into(result, reply))

    return handle


def _into(result: PushPulled, reply: List[torch.Tensor]) -> tuple:
    """Copy the values into the reply slot; what goes back down the pipe is the rest (`PushPulled.header`)."""
    if reply:
        torch._foreach_copy_(reply, list(result.pulled.values))
    return result.header()
