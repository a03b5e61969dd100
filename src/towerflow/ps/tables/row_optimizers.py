"""Row-wise optimizers: the update a sparse optimizer makes to the rows one push touches.

An embedding table on a ps is updated a few rows at a time, and its optimizer state is
sharded with the rows (one state row per value row), so an update reads and writes only the
rows it names. Each class here is a frozen spec (plain data: it travels to the ps in a
message) that also knows its update:

* `SparseSGD` — `torch.optim.SGD` on a sparse gradient (TF's SparseApplyGradientDescent).
* `SparseAdagrad` — `torch.optim.Adagrad` on a sparse gradient (lr_decay counted per update
  of the shard, as torch counts its per-parameter `step`).
* `SparseAdam` — `torch.optim.SparseAdam` (TF's LazyAdamOptimizer): only the touched rows'
  moments move; the bias correction uses the shard's update count.
* `FTRL` — FTRL-Proximal exactly as TensorFlow's `ApplyFtrl` / `FtrlOptimizer` computes it.

`row_optimizer_for` picks the one that matches a user's torch optimizer, or says why none does.
Gradients must be coalesced (unique rows, duplicates summed: `coalesce`), as torch and TF
do before a sparse update: these updates are not linear in the gradient.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

import torch

from towerflow.errors import ParameterServerError

State = Dict[str, torch.Tensor]

_FIX = ("pass sparse_optimizer=towerflow.ps.SparseAdagrad(lr=...) (or SparseSGD, SparseAdam, FTRL) to "
        "strategy.setup to say how the table's rows are updated")


def coalesce(ids: torch.Tensor, grads: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Unique ids (sorted, int64) and the sum of each one's gradient rows: what `apply` expects."""
    unique, inverse = torch.unique(ids.long(), return_inverse=True)
    summed = torch.zeros((unique.numel(),) + tuple(grads.shape[1:]), dtype=grads.dtype, device=grads.device)
    return unique, summed.index_add_(0, inverse, grads)


def _require(spec: "RowOptimizer", name: str, ok, expected: str) -> None:
    """Check one setting; `ok` is a test of the value (a float, after `_as_floats`)."""
    if not ok(getattr(spec, name)):
        raise ParameterServerError(
            f"{type(spec).__name__}({name}={getattr(spec, name)!r}): expected {expected}; pass a valid {name}"
        )


def _as_floats(spec: "RowOptimizer", *names: str) -> None:
    """Settings as plain floats (a tensor lr would not pickle small, an int compares the same), or a clear error."""
    for name in names:
        value = getattr(spec, name)
        try:
            object.__setattr__(spec, name, float(value))
        except (TypeError, ValueError):
            raise ParameterServerError(f"{type(spec).__name__}({name}={value!r}): expected a number") from None


class RowOptimizer:
    """Base class: per-row state shaped like the values, and an in-place update of some rows."""

    state_names: Tuple[str, ...] = ()

    def init_state(self, values: torch.Tensor) -> State:
        """Fresh state for every row of `values` (a new table, or rows just created)."""
        return {}

    def apply(self, values: torch.Tensor, state: State, rows: torch.Tensor, grads: torch.Tensor, step: int,
              lr: Optional[float] = None, lr_scale: float = 1.0) -> None:
        """Update `values[rows]` and their state in place.

        rows: unique int64 indices into `values` [R, D]; grads: [len(rows), D], coalesced;
        step: the shard's update count including this one (torch's per-parameter `step`);
        lr: replaces the spec's lr (a worker's schedule); lr_scale multiplies it (staleness).
        """
        raise NotImplementedError  # pragma: no cover - abstract

    def _lr(self, lr: Optional[float], lr_scale: float) -> float:
        return float(self.lr if lr is None else lr) * float(lr_scale)

    def describe(self) -> str:
        fields = dataclasses.fields(self) if dataclasses.is_dataclass(self) else ()
        return f"row-wise {type(self).__name__}(" + ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields) + ")"


@dataclasses.dataclass(frozen=True)
class SparseSGD(RowOptimizer):
    """values[rows] -= lr * grads: torch.optim.SGD without momentum or weight decay."""

    lr: float

    def __post_init__(self):
        _as_floats(self, "lr")
        _require(self, "lr", lambda v: v >= 0, "a learning rate >= 0")

    def apply(self, values, state, rows, grads, step, lr=None, lr_scale=1.0):
        values.index_add_(0, rows, grads * -self._lr(lr, lr_scale))  # index_add_'s alpha= path is ~6x slower on CPU


@dataclasses.dataclass(frozen=True)
class SparseAdagrad(RowOptimizer):
    """torch.optim.Adagrad on touched rows: sum += g^2; w -= clr * g / (sqrt(sum) + eps)."""

    lr: float
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    lr_decay: float = 0.0
    state_names = ("sum",)

    def __post_init__(self):
        _as_floats(self, "lr", "initial_accumulator_value", "eps", "lr_decay")
        _require(self, "lr", lambda v: v >= 0, "a learning rate >= 0")
        _require(self, "initial_accumulator_value", lambda v: v >= 0, "a value >= 0")
        _require(self, "eps", lambda v: v >= 0, "eps >= 0")
        _require(self, "lr_decay", lambda v: v >= 0, "lr_decay >= 0")

    def init_state(self, values):
        return {"sum": torch.full_like(values, self.initial_accumulator_value)}

    def apply(self, values, state, rows, grads, step, lr=None, lr_scale=1.0):
        clr = self._lr(lr, lr_scale) / (1 + (step - 1) * self.lr_decay)  # torch's decay, per update
        total = state["sum"].index_select(0, rows).add_(grads.pow(2))
        state["sum"].index_copy_(0, rows, total)
        values.index_add_(0, rows, grads.div(total.sqrt_().add_(self.eps)).mul_(-clr))


@dataclasses.dataclass(frozen=True)
class SparseAdam(RowOptimizer):
    """torch.optim.SparseAdam: lazy Adam, only touched rows' moments decay."""

    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    state_names = ("exp_avg", "exp_avg_sq")

    def __post_init__(self):
        _as_floats(self, "lr", "eps")
        try:
            object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))  # a list would not hash
        except (TypeError, ValueError):
            pass  # refused just below, with the value as given
        _require(self, "lr", lambda v: v > 0, "a learning rate > 0")
        _require(self, "betas", lambda v: isinstance(v, tuple) and len(v) == 2 and all(0 <= b < 1 for b in v),
                 "two coefficients in [0, 1)")
        _require(self, "eps", lambda v: v > 0, "eps > 0")

    def init_state(self, values):
        return {"exp_avg": torch.zeros_like(values), "exp_avg_sq": torch.zeros_like(values)}

    def apply(self, values, state, rows, grads, step, lr=None, lr_scale=1.0):
        beta1, beta2 = self.betas
        # the operations, in order, of torch.optim._functional.sparse_adam
        old_m = state["exp_avg"].index_select(0, rows)
        m_update = grads.sub(old_m).mul_(1 - beta1)
        state["exp_avg"].index_copy_(0, rows, old_m + m_update)
        old_v = state["exp_avg_sq"].index_select(0, rows)
        v_update = grads.pow(2).sub_(old_v).mul_(1 - beta2)
        state["exp_avg_sq"].index_copy_(0, rows, old_v + v_update)
        numer = m_update.add_(old_m)
        denom = v_update.add_(old_v).sqrt_().add_(self.eps)
        step_size = self._lr(lr, lr_scale) * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        values.index_add_(0, rows, -step_size * numer.div_(denom))


@dataclasses.dataclass(frozen=True)
class FTRL(RowOptimizer):
    """FTRL-Proximal as TensorFlow computes it (tf.raw_ops.ApplyFtrl / SparseApplyFtrl, tf.train.FtrlOptimizer).

    TF's documented update (tensorflow/core/kernels/training_ops.cc, ApplyFtrl functor):
        accum_new = accum + grad * grad
        linear += grad - (accum_new^(-lr_power) - accum^(-lr_power)) / lr * var
        quadratic = 1.0 / (accum_new^(lr_power) * lr) + 2 * l2
        var = (sign(linear) * l1 - linear) / quadratic if |linear| > l1 else 0.0
        accum = accum_new
    with sqrt in place of the power when lr_power == -0.5, as the kernel does. The state is
    TF's two slots, "accum" (starting at initial_accumulator_value) and "linear" (zeros). An
    l1 > 0 sets rarely useful weights to exactly 0: sparse models, as in McMahan et al. 2013.
    """

    lr: float
    l1: float = 0.0
    l2: float = 0.0
    initial_accumulator_value: float = 0.1
    lr_power: float = -0.5
    state_names = ("accum", "linear")

    def __post_init__(self):
        _as_floats(self, "lr", "l1", "l2", "initial_accumulator_value", "lr_power")
        _require(self, "lr", lambda v: v > 0, "a learning rate > 0 (FTRL divides by it)")
        _require(self, "l1", lambda v: v >= 0, "l1 >= 0")
        _require(self, "l2", lambda v: v >= 0, "l2 >= 0")
        _require(self, "initial_accumulator_value", lambda v: v >= 0, "a value >= 0")
        _require(self, "lr_power", lambda v: v <= 0, "lr_power <= 0 (0 keeps the learning rate fixed)")

    def init_state(self, values):
        return {"accum": torch.full_like(values, self.initial_accumulator_value), "linear": torch.zeros_like(values)}

    def _power(self, accum: torch.Tensor) -> torch.Tensor:
        return accum.sqrt() if self.lr_power == -0.5 else accum.pow(-self.lr_power)

    def apply(self, values, state, rows, grads, step, lr=None, lr_scale=1.0):
        lr = self._lr(lr, lr_scale)
        var = values.index_select(0, rows)
        accum = state["accum"].index_select(0, rows)
        accum_new = accum + grads * grads
        new_power = self._power(accum_new)
        linear = state["linear"].index_select(0, rows)
        linear.add_(grads - (new_power - self._power(accum)) / lr * var)
        quadratic = new_power / lr + 2 * self.l2
        shrunk = (self.l1 * linear.sign() - linear) / quadratic
        var = torch.where(linear.abs() > self.l1, shrunk, torch.zeros_like(shrunk))
        values.index_copy_(0, rows, var)
        state["accum"].index_copy_(0, rows, accum_new)
        state["linear"].index_copy_(0, rows, linear)


SPARSE_OPTIMIZERS = (SparseSGD, SparseAdagrad, SparseAdam, FTRL)


def _refuse(name: str, why: str) -> ParameterServerError:
    return ParameterServerError(f"{name} has no exact row-wise form for an embedding table on the ps: {why}; {_FIX}")


def _settings(group: dict, name: str, **zero) -> None:
    """Refuse a setting that is on (momentum, weight decay, ...): it would touch rows the push did not."""
    for key, why in zero.items():
        value = group.get(key, 0)
        if value:
            raise _refuse(f"{name}({key}={value!r})", why)


def row_optimizer_for(optimizer: torch.optim.Optimizer, group: int = 0) -> RowOptimizer:
    """The row optimizer that updates a table's rows as `optimizer` would (its param_groups[group] settings)."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ParameterServerError(f"row_optimizer_for({optimizer!r}): expected a torch.optim.Optimizer; {_FIX}")
    if not 0 <= group < len(optimizer.param_groups):
        raise ParameterServerError(
            f"row_optimizer_for(group={group!r}): {name} has {len(optimizer.param_groups)} param group(s); pass the "
            "index of the group that holds the table"
        )
    g = optimizer.param_groups[group]
    lr = float(g["lr"])
    maximize = {"maximize": "it ascends; negate the loss instead"}
    decay = {"weight_decay": "weight decay shrinks every row at every step, touched or not"}
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        _settings(g, name, momentum="momentum keeps moving rows a push did not touch",
                  nesterov="nesterov needs momentum", **decay, **maximize)
        return SparseSGD(lr)
    if kind is torch.optim.Adagrad:
        _settings(g, name, **decay, **maximize)
        return SparseAdagrad(lr, float(g["initial_accumulator_value"]), float(g["eps"]), float(g["lr_decay"]))
    if kind in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SparseAdam):
        _settings(g, name, amsgrad="amsgrad keeps a running maximum torch.optim.SparseAdam does not have",
                  **({} if kind is torch.optim.SparseAdam else decay), **maximize)
        return SparseAdam(lr, tuple(float(b) for b in g["betas"]), float(g["eps"]))
    raise _refuse(name, "only SGD (no momentum), Adagrad, Adam / AdamW (no weight decay, no amsgrad) and SparseAdam "
                        "map onto row-wise updates")


def torch_optimizer_for(spec: RowOptimizer, params) -> torch.optim.Optimizer:
    """The torch optimizer that trains tables held in this process as `spec` trains them on the ps (one
    process, or replicas without parameter servers: the same script's `sparse_optimizer=`)."""
    params = list(params)
    if isinstance(spec, SparseSGD):
        return torch.optim.SGD(params, lr=spec.lr)
    if isinstance(spec, SparseAdagrad):
        return torch.optim.Adagrad(params, lr=spec.lr, lr_decay=spec.lr_decay,
                                   initial_accumulator_value=spec.initial_accumulator_value, eps=spec.eps)
    if isinstance(spec, SparseAdam):
        return torch.optim.SparseAdam(params, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps)
    raise ParameterServerError(
        f"{spec.describe() if isinstance(spec, RowOptimizer) else spec!r} has no torch optimizer to train tables held "
        "in this process; it runs on parameter servers only (launch with --ps N), or choose SparseSGD, SparseAdagrad "
        "or SparseAdam")
