"""The optimizer wrapper every strategy returns: one synchronous update per `step()`.

It keeps the user's optimizer and adds what TF's `apply_gradients(global_step=...)` gave:
the global step, a learning rate keyed on it, clipping of the combined gradient, the fp16
loss scaler, and, with `variables_on="cpu"`, TF's multi-GPU tower layout where the variables live on
the CPU, each replica's gradients come down to it, are averaged there, and the updated values
go back to the device.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from towerflow.errors import StrategyError


class _HostVariables:
    """CPU master copies of the parameters and an optimizer of the user's type over them."""

    def __init__(self, params: List[torch.nn.Parameter], optimizer: torch.optim.Optimizer, average: Callable):
        self.params = params
        self.masters = [p.detach().to("cpu", copy=True).requires_grad_(p.requires_grad) for p in params]
        by_id = {id(p): m for p, m in zip(params, self.masters)}
        missing = [g for g in optimizer.param_groups for p in g["params"] if id(p) not in by_id]
        if missing:
            raise StrategyError(
                "variables_on='cpu' needs an optimizer built over model.parameters(); it holds parameters that are "
                "not the model's. Build the optimizer from the same model passed to strategy.setup()."
            )
        groups = [{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
        self.optimizer = type(optimizer)(groups, **optimizer.defaults)
        self.average = average

    def pull_gradients(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = _flatten_dense_tensors([g.detach() for g in grads]).to("cpu")
        self.average(flat)
        for m, g in zip(self.masters, _unflatten_dense_tensors(flat, self.masters)):
            m.grad = g

    @torch.no_grad()
    def push_values(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.copy_(m, non_blocking=True)


class SyncOptimizer:
    """Wraps a torch optimizer; `step()` is one synchronous update and advances `global_step`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        strategy,
        lr_schedule: Optional[Callable[[int], float]] = None,
        clip_grad_norm: Optional[float] = None,
        scaler: Optional["torch.amp.GradScaler"] = None,
        host_variables: Optional[_HostVariables] = None,
    ):
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise StrategyError(f"clip_grad_norm={clip_grad_norm!r}: expected a positive number or None")
        if host_variables is not None and scaler is not None:
            raise StrategyError(
                "variables_on='cpu' with mixed_precision='fp16' is not supported: use mixed_precision='bf16' "
                "(no loss scaling needed) or keep the variables on the device"
            )
        self.optimizer = optimizer
        self.strategy = strategy
        self.lr_schedule = lr_schedule
        self.clip_grad_norm = clip_grad_norm
        self.scaler = scaler
        self.host = host_variables
        self.last_grad_norm: Optional[float] = None

    @property
    def _active(self) -> torch.optim.Optimizer:
        return self.host.optimizer if self.host is not None else self.optimizer

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The torch optimizer that applies the update (the CPU one with variables_on='cpu'); give
        this one to a `torch.optim.lr_scheduler` if you use those instead of `lr_schedule=`."""
        return self._active

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("optimizer", "host"):
            raise AttributeError(name)
        return getattr(self._active, name)  # defaults, add_param_group, ... of the wrapped optimizer

    @property
    def param_groups(self):
        return self._active.param_groups

    @property
    def state(self):
        return self._active.state

    @property
    def global_step(self) -> int:
        return self.strategy.global_step

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self.host is not None:
            self.host.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """Apply the combined gradient once, on every replica alike."""
        if closure is not None:
            raise StrategyError("step(closure) is not supported by synchronous strategies: call step() after backward()")
        if self.host is not None:
            self.host.pull_gradients()
        opt = self._active
        if self.lr_schedule is not None:
            lr = float(self.lr_schedule(self.strategy.global_step))
            for group in opt.param_groups:
                group["lr"] = lr
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        if self.clip_grad_norm is not None:
            params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm))
        with self.strategy._update_threads():
            if self.scaler is not None:
                self.scaler.step(opt)
                self.scaler.update()
            else:
                opt.step()
        if self.host is not None:
            self.host.push_values()
        self.strategy.steps.advance()

    def state_dict(self) -> dict:
        out = {"optimizer": self._active.state_dict(), "global_step": self.strategy.global_step}
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self._active.load_state_dict(state["optimizer"])
        self.strategy.steps.restore(int(state.get("global_step", 0)))
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        if self.host is not None:
            self.host.push_values()

    def __repr__(self) -> str:
        return f"SyncOptimizer({type(self.optimizer).__name__}, global_step={self.strategy.global_step})"


def move_state_to_params(optimizer: torch.optim.Optimizer) -> None:
    """Put each parameter's optimizer state on that parameter's device, after `model.to(device)`.

    Some optimizers (Adagrad) make their state when built, on the device the parameters had then; the step
    counters stay where torch keeps them (the CPU, unless the optimizer is capturable)."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.device != param.device:
                state[key] = value.to(param.device)
