"""Towers in one process: the mechanics behind `TowersStrategy` (`towers_strategy.py`), several CPU
devices as threads of one process, and the rule that picks them (`towers_mode`).

TF's MirroredStrategy with logical CPUs: one tower per device in one process, gradients summed in
memory (the towers share the parameter tensors; torch ops release the GIL, so the towers' ops run
in parallel). `TowerModule` wraps the user's module and the loop stays the same:

* forward: the batch (dim 0 of every tensor argument) is cut into one chunk per tower, sizes
  differing by at most one, the first towers larger (`ShardSampler`'s rule); each tower runs the
  module on its chunk in its own thread (tower 0 in the calling one), with the parameters
  themselves; the outputs are concatenated along dim 0, so the loss sees the whole batch.
* backward (`_TowersFunction`): the output gradient is cut the same way; each tower runs
  `torch.autograd.grad` over its own graph, then sums one group of parameters' gradients over the
  towers; autograd gets the sums: `.grad` is the full-batch gradient up to float summation order.

Refused, with an error that says what to do: BatchNorm (running statistics) in training mode,
outputs that are not tensors with a batch dimension (alone or in tuples, lists, dicts), tensor
arguments of different batch sizes, a second backward through one forward, double backward, GPU
devices (towers on GPUs are not built). Measured: docs/benchmarks.md, "Towers in one process".
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from towerflow.devices import logical as _logical
from towerflow.errors import StrategyError
from towerflow.strategies._devices import resolve_device
from towerflow.strategies.tower_pool import TowerPool

TOWERS = ("threads", "processes")


# ---------------------------------------------------------------- which towers
def towers_mode(towers: Optional[str], env, devices: Optional[Sequence[str]]) -> str:
    """'threads' or 'processes' for MirroredStrategy(towers=..., devices=...) in this process (`env`).

    The default rule: threads when this process is alone (not one of a launcher's replica
    processes) and has several CPU devices to train on: `devices` names several, or `devices` is
    left out and the CPU is split into several logical devices (and there is no GPU). Otherwise
    processes, today's layout (one replica per process, DDP).
    """
    if towers not in (None, *TOWERS):
        raise StrategyError(f"towers={towers!r}: expected one of {TOWERS} or None (chosen by the rule in docs/training.md)")
    alone = env.world_size <= 1 and not env.assigned_device
    if towers == "threads" and not alone:
        raise StrategyError(
            f"towers='threads' in replica process {env.rank} of {env.world_size}: towers in one process and a "
            "replica group of several processes are not combined. Run one process with the devices as towers "
            "(plain `python script.py`), or drop towers='threads' to train one replica per process"
        )
    if towers is not None:
        return towers
    if not alone:
        return "processes"
    if devices is not None:
        return "threads" if len(devices) > 1 and all(resolve_device(d)[0].type == "cpu" for d in devices) else "processes"
    table = _logical.table()
    cpus = [d for d in table.devices if d.device_type == "CPU"]
    return "threads" if len(cpus) > 1 and not table.has_type("GPU") else "processes"


def tower_devices(devices: Optional[Sequence[str]]) -> List[str]:
    """Full TF names of the towers' devices: `devices`, else every logical CPU device of this task."""
    if devices is None:
        devices = [d.short_name for d in _logical.table().devices if d.device_type == "CPU"]
    placed = [resolve_device(d) for d in devices]
    gpus = [name for device, name in placed if device.type != "cpu"]
    if gpus:
        raise StrategyError(
            f"towers='threads' on {gpus}: towers in one process are built for CPU devices only. Train one process "
            f"per GPU with `towerflow launch --nproc {len(placed)} script.py` (towers='processes')"
        )
    names = [name for _, name in placed]
    if len(set(names)) != len(names):
        raise StrategyError(f"devices={list(devices)!r} names a device twice: list each tower's device once")
    return names


# ---------------------------------------------------------------- nested tensors (args, outputs)
def _flatten(obj: Any, what: str) -> Tuple[List[Any], Callable[[List[Any]], Any]]:
    """The leaves of tensors / tuples / lists / dicts, and a function that rebuilds `obj` from new leaves."""
    if isinstance(obj, (tuple, list)):
        parts = [_flatten(o, what) for o in obj]
        counts = [len(p[0]) for p in parts]
        kind = type(obj)

        def rebuild(leaves):
            items, at = [], 0
            for (_, build), n in zip(parts, counts):
                items.append(build(leaves[at:at + n]))
                at += n
            return kind(*items) if hasattr(obj, "_fields") else kind(items)

        return [leaf for p in parts for leaf in p[0]], rebuild
    if isinstance(obj, dict):
        keys = list(obj)
        inner, build = _flatten([obj[k] for k in keys], what)
        return inner, lambda leaves: type(obj)(zip(keys, build(leaves)))
    if what == "output" and not isinstance(obj, torch.Tensor):
        raise StrategyError(
            f"the model returned a {type(obj).__name__} ({obj!r:.60}): with towers='threads' a model returns tensors "
            "with a batch dimension, or tuples / lists / dicts of them, which the towers' outputs are concatenated into"
        )
    return [obj], lambda leaves: leaves[0]


def _chunk_bounds(size: int, towers: int) -> List[Tuple[int, int]]:
    """Non-empty [start, stop) per tower; sizes differ by at most one, the first towers larger (ShardSampler's rule)."""
    base, extra = divmod(size, towers)
    bounds, start = [], 0
    for i in range(towers):
        stop = start + base + (1 if i < extra else 0)
        if stop > start:
            bounds.append((start, stop))
        start = stop
    return bounds


def _batch_size(leaves: List[Any]) -> Optional[int]:
    sizes = {tuple(t.shape[:1]) for t in leaves if isinstance(t, torch.Tensor)}
    if len(sizes) > 1 or () in sizes:
        raise StrategyError(
            f"the tensor arguments have batch sizes {sorted(sizes)}: towers cut every tensor argument along dim 0 "
            "into one chunk per tower, so they all need the same dim 0. Pass other tensors as module attributes"
        )
    return sizes.pop()[0] if sizes else None


def _merge(outputs: List[List[torch.Tensor]], bounds) -> List[torch.Tensor]:
    merged = []
    for leaves in zip(*outputs):
        for t, (start, stop) in zip(leaves, bounds):
            if t.dim() == 0 or t.shape[0] != stop - start:
                raise StrategyError(
                    f"the model returned a tensor of shape {tuple(t.shape)} for a chunk of {stop - start} samples: with "
                    "towers='threads' every output has the batch as dim 0 (the towers' outputs are concatenated). "
                    "Return per-sample outputs and reduce them (the loss) outside the model"
                )
        merged.append(torch.cat(leaves))
    return merged


# ---------------------------------------------------------------- the module and its autograd function
class TowerModule(nn.Module):
    """The user's `module`, run as `num_towers` towers (threads) over chunks of each batch; see the module docstring."""

    def __init__(self, module: nn.Module, pool: TowerPool):
        super().__init__()
        self.module = module
        self.pool = pool
        self.num_towers = pool.num_towers
        self._running_stats = [m for m in module.modules()
                               if getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, rebuild = _flatten((args, kwargs), "input")
        size = _batch_size(leaves)
        if size is None:
            raise StrategyError(
                "the model was called with no tensor argument: towers='threads' cuts the batch (dim 0 of the tensor "
                "arguments) into one chunk per tower"
            )
        bounds = _chunk_bounds(size, self.num_towers)
        if len(bounds) < 2:  # a batch of 0 or 1 samples: one tower's work, in this thread
            return self.module(*args, **kwargs)
        busy = [type(m).__name__ for m in self._running_stats if m.training]
        if busy:
            raise StrategyError(
                f"{busy[0]} in training mode with towers='threads': its running statistics would be updated by "
                "several threads at once. Use GroupNorm / LayerNorm, put the BatchNorm modules in eval mode, or "
                "train one replica per process (towers='processes', `towerflow launch --nproc N`)"
            )
        call = _Call(self.module, self.pool, leaves, rebuild, bounds)
        params = [p for p in self.module.parameters() if p.requires_grad]
        inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if not torch.is_grad_enabled() or not (params or inputs):
            merged = _merge(self.pool.run(lambda i: call.run(i, grad=False)[0], len(bounds)), bounds)
        else:
            call.params, call.inputs = params, inputs
            merged = list(_TowersFunction.apply(call, *params, *inputs))
        return call.build_output(merged)  # set by tower 0's forward


class _Call:
    """One forward through the towers: the chunks, each tower's graph, and how to rebuild the output."""

    def __init__(self, module: nn.Module, pool: TowerPool, leaves, rebuild, bounds):
        self.module, self.pool, self.leaves, self.rebuild, self.bounds = module, pool, leaves, rebuild, bounds
        self.params: List[torch.Tensor] = []
        self.inputs: List[torch.Tensor] = []
        self.chunks: List[List[torch.Tensor]] = []  # per tower: its leaf chunks that require grad
        self.outs: Optional[List[List[torch.Tensor]]] = None  # per tower: its outputs, with their graphs
        self.autocast = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        self.build_output = None

    def run(self, tower: int, grad: bool):
        """Tower `tower`'s forward on its chunk: (its output leaves, its chunks of the inputs that require grad)."""
        start, stop = self.bounds[tower]
        chunked, own = [], []
        for t in self.leaves:
            if isinstance(t, torch.Tensor):
                t = t[start:stop]
                if grad and t.requires_grad:
                    t = t.detach().requires_grad_()  # this tower's leaf: autograd.grad stops here
                    own.append(t)
            chunked.append(t)
        args, kwargs = self.rebuild(chunked)
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=self.autocast[1], enabled=self.autocast[0]):
            out = self.module(*args, **kwargs)
        leaves, build = _flatten(out, "output")
        if tower == 0:
            self.build_output = build
        return leaves, own

    def grads(self, tower: int, grad_outputs: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        start, stop = self.bounds[tower]
        pairs = [(o, g[start:stop]) for o, g in zip(self.outs[tower], grad_outputs) if o.requires_grad and g is not None]
        wrt = self.params + self.chunks[tower]
        if not pairs:
            return [None] * len(wrt)
        outs, gs = zip(*pairs)
        return list(torch.autograd.grad(outs, wrt, gs, allow_unused=True))


def _groups(params: List[torch.Tensor], n: int) -> List[List[int]]:
    """Parameter indices in n groups of about equal numel (largest first, each to the lightest group)."""
    groups, load = [[] for _ in range(n)], [0] * n
    for j in sorted(range(len(params)), key=lambda j: -params[j].numel()):
        k = load.index(min(load))
        groups[k].append(j)
        load[k] += params[j].numel()
    return groups


def _owned(grads: List[Optional[torch.Tensor]], grad_outputs) -> List[bool]:
    """Which of one tower's gradients own their storage (all of it, shared with nothing else): safe to add into."""
    def storage(t):
        return t.untyped_storage().data_ptr()

    outside = {storage(g) for g in grad_outputs if g is not None}
    counts: dict = {}
    for g in grads:
        if g is not None:
            counts[storage(g)] = counts.get(storage(g), 0) + 1
    return [g is not None and counts[storage(g)] == 1 and storage(g) not in outside
            and g.numel() * g.element_size() == g.untyped_storage().nbytes() for g in grads]


class _TowersFunction(torch.autograd.Function):
    """Forward: the towers' forwards in parallel; backward: their autograd.grad in parallel, gradients summed."""

    @staticmethod
    def forward(ctx, call: _Call, *tensors: torch.Tensor):
        results = call.pool.run(lambda i: call.run(i, grad=True), len(call.bounds))
        call.outs = [leaves for leaves, _ in results]
        call.chunks = [own for _, own in results]
        merged = _merge([[o.detach() for o in outs] for outs in call.outs], call.bounds)
        ctx.call = call
        ctx.mark_non_differentiable(*[m for m, o in zip(merged, call.outs[0]) if not o.requires_grad])
        return tuple(merged)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: torch.Tensor):
        call: _Call = ctx.call
        if call.outs is None:
            raise StrategyError(
                "a second backward through one forward of towers='threads' (retain_graph=True): each tower frees its "
                "graph after the first backward. Run the forward again"
            )
        towers = len(call.bounds)
        num_params = len(call.params)
        groups = _groups(call.params, towers)
        per_tower: List[Optional[List[Optional[torch.Tensor]]]] = [None] * towers
        summed: List[Optional[torch.Tensor]] = [None] * num_params
        owned: List[List[bool]] = [[]] * towers
        all_done = threading.Barrier(towers)

        def tower(i: int) -> None:  # its graph's gradients, then (all towers done) the sums of one group of parameters
            try:
                per_tower[i] = call.grads(i, list(grad_outputs))
                owned[i] = _owned(per_tower[i], grad_outputs)
            except BaseException:
                all_done.abort()
                raise
            try:
                all_done.wait()
            except threading.BrokenBarrierError:
                return  # another tower failed: its error is raised
            for j in groups[i]:
                parts = [(g[j], own) for g, own in zip(per_tower, owned) if g[j] is not None]
                if len(parts) == 1:
                    summed[j] = parts[0][0]
                elif parts:  # into the first gradient nothing else holds (saves an allocation), else a new tensor
                    first = next((k for k, (_, own) in enumerate(parts) if own[j]), None)
                    acc = parts[first][0] if first is not None else parts[0][0] + parts[1][0]
                    for k, (g, _) in enumerate(parts):
                        if k != first and (first is not None or k > 1):
                            acc.add_(g)
                    summed[j] = acc

        call.pool.run(tower, towers)
        call.outs = call.chunks = None  # the towers' graphs are freed
        inputs = []
        for k, x in enumerate(call.inputs):
            parts = [g[num_params + k] for g in per_tower]
            if all(p is None for p in parts):
                inputs.append(None)
                continue
            shapes = [(stop - start, *x.shape[1:]) for start, stop in call.bounds]
            inputs.append(torch.cat([p if p is not None else x.new_zeros(s) for p, s in zip(parts, shapes)]))
        grads = (None, *summed, *inputs)
        per_tower.clear()  # the returned tuple holds the only references: AccumulateGrad takes the sums as .grad
        summed.clear()
        return grads
