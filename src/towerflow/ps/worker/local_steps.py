"""Local steps (geo-SGD, local SGD): a worker trains on its own for k steps, then sends what changed.

PaddlePaddle's geo mode. With `ParameterServerStrategy(local_steps=k)` (k > 1) the user's
optimizer steps here, on the worker's own parameters, every step; every k-th step the worker
pushes the change of its parameters since it last installed the ps's values (the *delta*:
local values minus those installed values, `PushPull(kind="delta")`) and installs the values
the ps has now. The ps adds a delta to its values (sync: the mean of the aggregated deltas,
which is model averaging) and never runs its optimizer on it; a delta counts as one push, so
the modes (async / sync with backups / ssp) and the global step count pushes as before. The
local optimizer's state (Adam's moments, momentum) stays here and survives the installs.

The ps weighs a delta by 1 / the active workers in async and ssp (a round of every worker's push
then adds their mean, as sync's aggregated update does); docs/parameter-server.md, "Local steps
(geo)", says why and what it measured.

The delta travels in the parameters' `.grad` slots, which `Channel.gather` packs (the local
optimizer has used the gradients by then); they are cleared after the push.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from towerflow.errors import ParameterServerError


def check_local_steps(local_steps) -> int:
    """`local_steps` as an int >= 1 (None is 1: a gradient push every step), or a ParameterServerError."""
    if local_steps is None:
        return 1
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ParameterServerError(
            f"local_steps={local_steps!r}: expected a whole number k >= 1 (1 or None pushes gradients every step; "
            "k > 1 takes k steps of the optimizer on the worker, then pushes the parameter delta), e.g. local_steps=4"
        )
    return local_steps


class LocalSteps:
    """One worker's geo rounds: k steps of the user's optimizer here, then one delta push and an install."""

    def __init__(self, optimizer: torch.optim.Optimizer, client, recovery, params: Sequence[torch.nn.Parameter],
                 k: int):
        self.optimizer = optimizer  # the user's: it steps here, over the worker's parameters, keeping its state
        self.client = client
        self.recovery = recovery
        self.params = list(params)
        self.k = k
        self.taken = 0  # local steps since the values were last installed
        self.local_steps = 0  # local steps in all
        self._base: List[torch.Tensor] = [p.detach().clone() for p in self.params]  # the values last installed
        self._delta: List[torch.Tensor] = [torch.empty_like(p) for p in self.params]  # reused every push
        self._tickets: tuple = ()
        self.rebase()

    def _installed(self) -> tuple:
        # Every install (ours, a recovery's, a checkpoint load's) sets each channel's ticket to the reply's.
        return tuple(ch.ticket for ch in self.client.channels)

    def rebase(self) -> None:
        """The model holds freshly installed values: the next delta is measured from them, and a round of k
        local steps starts."""
        with torch.no_grad():
            torch._foreach_copy_(self._base, [p.detach() for p in self.params])
        self._tickets = self._installed()
        self.taken = 0

    def step(self, lr: Optional[float], push: Callable[[], None]) -> bool:
        """One local optimizer step (`lr` from the schedule, when given); on the k-th, `push()` sends the delta
        (`PSClient.push_pull(..., kind="delta")` under the recovery rules). Returns whether it pushed."""
        if any(a is not b for a, b in zip(self._installed(), self._tickets)):
            self.rebase()  # values were installed since (a recovery, a checkpoint load): measure from those
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        self.taken += 1
        self.local_steps += 1
        if self.taken < self.k:
            return False
        with torch.no_grad():
            torch._foreach_copy_(self._delta, [p.detach() for p in self.params])
            torch._foreach_sub_(self._delta, self._base)
        for p, d in zip(self.params, self._delta):
            p.grad = d
        try:
            push()
        finally:
            for p in self.params:
                p.grad = None
        self.rebase()
        return True

    def __repr__(self) -> str:
        return f"LocalSteps(k={self.k}, {self.taken} since the last push)"
