"""A worker's embedding tables, looked up through the ps tasks: the model stays plain PyTorch.

After `strategy.setup`, every table module (`nn.Embedding` / `nn.EmbeddingBag` with
`sparse=True`, or a `HashEmbedding`) keeps its class and its call, but holds no rows: they live
on the ps tasks (`ps/tables/`). A call of the model then runs in two passes:

1. **record**: the model's forward runs under `no_grad` in eval mode with each table answering
   zeros and noting the ids it was asked for; the first forward runs to the end and counts each
   table's calls (a table may be looked up several times: shared by features), and later ones stop
   as soon as every table has had that many (nothing past the last lookup is computed);
2. **fetch**: the unique ids of every table go to the ps tasks in one call per task
   (`PSClient.read_rows`), and come back as one small weight per table (`unique ids x dim`), a
   leaf that collects the gradient;
3. **compute**: the forward runs for real, each table's call computed by `F.embedding` /
   `F.embedding_bag` over its small weight with the ids renumbered into it.

After `backward()` each small weight's gradient is the table's gradient, coalesced: one row per
unique id. `take_row_grads` hands them to the optimizer's push. A table called outside the
model's forward (`model.emb(ids)`) fetches on its own. The forward must look up the same ids in
both passes (ids computed from embedding values are refused, with the table named).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from towerflow.errors import ParameterServerError
from towerflow.ps.tables import TableSpec

Reader = Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]


class _EveryTableSeen(Exception):
    """Stops the recording pass once every table has been called."""


@dataclasses.dataclass
class _Call:
    """One call of one table: its ids (and bag offsets / weights) as given."""

    ids: torch.Tensor
    offsets: Optional[torch.Tensor]
    per_sample_weights: Optional[torch.Tensor]


@dataclasses.dataclass
class _Fetched:
    """One table's rows for this forward: the unique ids, their small weight, each call's renumbered ids."""

    unique: torch.Tensor
    weight: torch.Tensor
    local_ids: List[torch.Tensor]
    calls: List[_Call]


def _is_bag(module: nn.Module) -> bool:
    return isinstance(module, nn.EmbeddingBag) or getattr(module, "mode", None) is not None


def check_table_module(name: str, module: nn.Module) -> None:
    """Refuse table options the ps cannot honour row by row, naming the option and the fix."""
    for option, default in (("padding_idx", None), ("max_norm", None), ("scale_grad_by_freq", False)):
        if getattr(module, option, default) != default:
            raise ParameterServerError(
                f"table {name!r} sets {option}={getattr(module, option)!r}, which the parameter servers do not support "
                f"for tables they hold; drop it, or keep the table on the workers (sparse=False, below the partition "
                "threshold)")


class TableLookups:
    """Patches a model's table modules so that their rows come from the ps, and keeps their gradients."""

    def __init__(self, model: nn.Module, tables: Dict[str, nn.Module], read: Reader,
                 device: Optional[torch.device] = None):
        self.model = model
        self.tables = tables
        self.read = read
        self.device = device  # where the model computes: the recording pass's zeros are made there
        self.phase: Optional[str] = None
        self._calls: Dict[str, List[_Call]] = {}
        self._fetched: Dict[str, _Fetched] = {}
        self._next: Dict[str, int] = {}
        self._pending: Dict[str, _Fetched] = {}  # the last training forward's rows, until the optimizer pushes them
        self._calls_per_forward: Optional[Dict[str, int]] = None  # each table's calls in a whole forward
        for name, module in tables.items():
            check_table_module(name, module)
            module.forward = functools.partial(self._table_forward, name, module)
        self._model_forward = model.forward
        model.forward = self._forward

    # ---- the model's call
    def _forward(self, *args, **kwargs):
        self._record(args, kwargs)
        training = self.model.training and torch.is_grad_enabled()
        self._fetched = self._fetch({name: calls for name, calls in self._calls.items() if calls}, training)
        self._next = {name: 0 for name in self._fetched}
        self.phase = "compute"
        try:
            out = self._model_forward(*args, **kwargs)
        finally:
            self.phase = None
        if training:
            self._pending = self._fetched
        self._fetched = {}
        return out

    def _record(self, args, kwargs) -> None:
        self._calls = {name: [] for name in self.tables}
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.train(False)
        self.phase = "record"
        try:
            with torch.no_grad():
                self._model_forward(*args, **kwargs)
        except _EveryTableSeen:
            pass
        finally:
            self.phase = None
            for m, mode in modes:
                m.training = mode
        if self._calls_per_forward is None:
            self._calls_per_forward = {name: len(calls) for name, calls in self._calls.items()}

    def _fetch(self, calls: Dict[str, List[_Call]], training: bool) -> Dict[str, _Fetched]:
        unique, inverse = {}, {}
        for name, cs in calls.items():
            ids = torch.cat([c.ids.reshape(-1) for c in cs]) if len(cs) > 1 else cs[0].ids.reshape(-1)
            unique[name], inverse[name] = torch.unique(ids, return_inverse=True)
        rows = self.read(unique) if unique else {}
        out = {}
        for name, cs in calls.items():
            weight = rows[name].detach().requires_grad_(training)
            sizes = [c.ids.numel() for c in cs]
            local = [piece.view(c.ids.shape) for piece, c in zip(torch.split(inverse[name], sizes), cs)]
            out[name] = _Fetched(unique[name], weight, local, cs)
        return out

    # ---- one table's call
    def _table_forward(self, name: str, module: nn.Module, input: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                       per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        call = _Call(input, offsets, per_sample_weights)
        if self.phase == "record":
            self._calls[name].append(call)
            seen = self._calls_per_forward
            if seen is not None and all(len(self._calls[n]) >= seen[n] for n in seen):
                raise _EveryTableSeen()
            return self._zeros(module, call, self.device)
        if self.phase == "compute" and name in self._fetched:
            fetched = self._fetched[name]
            k = self._next[name]
            self._next[name] = k + 1
            if k >= len(fetched.calls) or not torch.equal(fetched.calls[k].ids, input):
                raise ParameterServerError(
                    f"table {name!r} was called with other ids than in the recording pass of this forward; towerflow "
                    "runs the forward twice (first to collect every table's ids): the ids must not depend on "
                    "embedding values or on randomness")
            return self._compute(module, fetched.weight, fetched.local_ids[k], call)
        # called on its own (outside the model's forward): fetch this call's rows now
        training = module.training and torch.is_grad_enabled()
        fetched = self._fetch({name: [call]}, training)[name]
        if training:
            self._pending[name] = fetched
        return self._compute(module, fetched.weight, fetched.local_ids[0], call)

    @staticmethod
    def _zeros(module: nn.Module, call: _Call, device: Optional[torch.device]) -> torch.Tensor:
        dim = module.embedding_dim
        device = device if device is not None else call.ids.device
        if not _is_bag(module):
            return torch.zeros(*call.ids.shape, dim, device=device)
        if call.ids.dim() == 2:
            bags = call.ids.shape[0]
        else:
            bags = call.offsets.numel() - (1 if getattr(module, "include_last_offset", False) else 0)
        return torch.zeros(bags, dim, device=device)

    @staticmethod
    def _compute(module: nn.Module, weight: torch.Tensor, local_ids: torch.Tensor, call: _Call) -> torch.Tensor:
        """The rows are on the model's device; the ids may stay on the host (they travel from there anyway)."""
        local_ids = local_ids.to(weight.device, non_blocking=True)
        if not _is_bag(module):
            return F.embedding(local_ids, weight)
        offsets, per_sample_weights = call.offsets, call.per_sample_weights
        if offsets is not None:
            offsets = offsets.to(weight.device, non_blocking=True)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(weight.device, non_blocking=True)
        return F.embedding_bag(local_ids, weight, offsets, mode=module.mode,
                               per_sample_weights=per_sample_weights,
                               include_last_offset=getattr(module, "include_last_offset", False))

    # ---- the optimizer's side
    def take_row_grads(self) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """{table: (unique ids, their gradient rows)} of the last training forward, once; tables the loss
        did not reach are left out."""
        pending, self._pending = self._pending, {}
        return {name: (f.unique, f.weight.grad) for name, f in pending.items() if f.weight.grad is not None}


# ---- which modules are tables
def is_table(module: nn.Module, partition) -> bool:
    """A table the ps holds: a HashEmbedding; an nn.Embedding / nn.EmbeddingBag built with sparse=True, on
    the meta device, or (partition=N bytes) at least N bytes big."""
    if getattr(module, "is_hash_table", False):
        return True
    if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return False
    weight = module.weight
    if module.sparse or weight.is_meta:
        return True
    return isinstance(partition, int) and not isinstance(partition, bool) and \
        weight.numel() * weight.element_size() >= partition


def find_tables(model: nn.Module, partition) -> Dict[str, nn.Module]:
    """The model's tables by module name (a table shared under two names counts once)."""
    out, seen = {}, set()
    for name, module in model.named_modules():
        if id(module) not in seen and is_table(module, partition):
            seen.add(id(module))
            out[name] = module
    return out


def table_spec(name: str, module: nn.Module, num_ps: int, partition_strategy: str, init_std: Optional[float],
               seed: int) -> TableSpec:
    """The wire description of one table module."""
    if getattr(module, "is_hash_table", False):
        return TableSpec(name, None, module.embedding_dim, module.dtype, num_ps, "hash", module.init_std, seed,
                         module.admit_after, module.evict_after, module.forget_after)
    rows, dim = module.weight.shape
    std = getattr(module, "init_std", None)  # the table's own (set on the module), else setup's, else PyTorch's N(0, 1)
    std = init_std if std is None else std
    return TableSpec(name, int(rows), int(dim), module.weight.dtype, num_ps, partition_strategy,
                     1.0 if std is None else float(std), seed)


def detach_rows(module: nn.Module) -> Optional[torch.Tensor]:
    """Take a table's weight out of the module (its rows live on the ps now): the values it had, or None
    when it was built on the meta device. The module keeps a meta `weight` of the same shape."""
    if getattr(module, "is_hash_table", False):
        return None
    weight = module._parameters.pop("weight")
    module.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
    return None if weight.is_meta else weight.detach()
