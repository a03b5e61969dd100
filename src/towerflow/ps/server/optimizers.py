"""A ps task's optimizers: the warm-up before serving, and their step without torch's per-step wrapper.

Which optimizers may run here at all is `ps/elementwise.py`'s rule, checked by the worker before it
sends anything and by the ps when it builds one.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.optim.optimizer as _torch_optimizer


def warm_up() -> None:
    """Build and drop a throwaway optimizer before serving.

    A process's first torch.optim optimizer imports torch._dynamo, seconds on a small machine. A ps
    task pays that while the workers build their models, not when the chief's first call creates the
    shards here with every worker waiting on it.
    """
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """`optimizer.step` without the wrapper torch.optim puts around every optimizer's step (a profiler record and
    the step hooks) while no hook is registered: on a ps task's same-host step the record alone took a sixth of the
    ps's Python time, more than the update of a small model. With a hook, or a torch without the wrapper, it is
    `optimizer.step` itself."""
    inner = getattr(type(optimizer).step, "__wrapped__", None)
    # the hook registries (registering adds to these very dicts); one missing: a torch whose hooks are kept elsewhere
    hooks = [getattr(_torch_optimizer, n, None) for n in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")]
    hooks += [getattr(optimizer, n, None) for n in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")]
    if any(h is None for h in hooks):
        inner = None

    def step() -> None:
        if inner is None or any(hooks):
            optimizer.step()
            return
        with torch.no_grad():
            inner(optimizer)

    return step
