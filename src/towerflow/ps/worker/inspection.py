"""Reading the ps tasks' state back: their checkpoints, the variables and tables put together, their counters.

For checkpoints (`PSOptimizer.state_dict`), checks and small exports; none of it is on a training
step's path. A checkpoint written with another number of ps tasks is resharded onto this layout.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from towerflow.errors import ParameterServerError
from towerflow.ps.messages import Endpoints
from towerflow.ps.worker import reshard as _reshard
from towerflow.ps.worker import rows as _rows
from towerflow.ps.worker.calls import PSCalls
from towerflow.ps.worker.model_on_ps import ModelOnPS


def state(calls: PSCalls) -> Dict[int, dict]:
    """Every ps task's checkpoint, by task."""
    return {ch.task: part for ch, part in zip(calls.channels, calls.on_all(Endpoints.state))}


def load_state(calls: PSCalls, model: ModelOnPS, parts: Dict[Any, dict]) -> None:
    """Put checkpoints (by task, int or str keys) back on the ps tasks, resharded when written with another
    number of ps tasks (or table partition)."""
    if model.replan is not None and _reshard.needs_reshard(parts, model.layout.num_ps, model.tables):
        old = model.replan(len(parts))
        parts = _reshard.reshard(parts, old, model.layout, model.tables, model.row_optimizer)
    missing = [ch.task for ch in calls.channels if ch.task not in parts and str(ch.task) not in parts]
    if missing:
        raise ParameterServerError(f"the checkpoint has no state for ps tasks {missing}; it was saved with another layout")
    calls.on_each(Endpoints.load_state, lambda ch: (parts.get(ch.task, parts.get(str(ch.task))),))


def values(calls: PSCalls, model: ModelOnPS) -> Dict[str, torch.Tensor]:
    """The current values on the ps tasks, reassembled per variable."""
    by_shard: Dict[str, torch.Tensor] = {}
    for part in calls.on_all(Endpoints.values):
        by_shard.update(part)
    layout = model.layout
    return {v: layout.assemble(v, [by_shard[s.name] for s in layout.shards_of(v)]) for v in layout.variables}


def table_values(calls: PSCalls, model: ModelOnPS) -> Dict[str, torch.Tensor]:
    """Every fixed table, put together from its shards on the ps tasks (for tests and small exports)."""
    return _rows.assemble(model.tables, dict(zip((ch.task for ch in calls.channels),
                                                 calls.on_all(Endpoints.table_values))))


def ps_metrics(calls: PSCalls) -> Dict[str, dict]:
    """Each ps task's counters, by task name."""
    return {f"/job:ps/task:{ch.task}": r for ch, r in zip(calls.channels, calls.on_all(Endpoints.metrics))}
