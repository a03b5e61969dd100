"""A ps checkpoint written with N ps tasks, put back onto M: dense shards and table rows redistributed.

A checkpoint part is what one ps task's `ShardService.state_dict()` returned. The dense variables
were packed into flat buffers by that run's `Layout` (which depends only on the model, the number
of ps tasks, the placement and the partition, so it is recomputed here); the tables' rows are
exported with their optimizer state and routed by the new `TableSpec`s. The chief does this before
it sends each new ps task its part, so a ps task only ever loads a part made for it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

import torch

from towerflow.errors import ParameterServerError
from towerflow.ps.layout import Layout
from towerflow.ps.tables import TableSpec
from towerflow.ps.tables.row_optimizers import RowOptimizer
from towerflow.ps.tables.table_shards import make_store


def saved_num_ps(parts: Mapping[Any, dict]) -> int:
    """How many ps tasks wrote these parts."""
    return len(parts)


def _by_task(parts: Mapping[Any, dict]) -> List[dict]:
    return [parts[k] for k in sorted(parts, key=int)]


# ---- dense variables
def _unflatten(layout: Layout, flats_by_task: List[List[torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Whole variables from each task's flat buffers (dtype order as the layout lists them)."""
    by_shard: Dict[str, torch.Tensor] = {}
    for task, flats in enumerate(flats_by_task):
        dtypes = list(layout.flat_sizes(task))
        by_shard.update(layout.unpack(task, dict(zip(dtypes, flats))))
    return {v: layout.assemble(v, [by_shard[s.name] for s in layout.shards_of(v)]) for v in layout.variables}


def _flatten(layout: Layout, task: int, values: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
    packed = layout.pack(task, values)
    return [packed[d] for d in layout.flat_sizes(task)]


def reshard_dense(old: Layout, new: Layout, parts: List[dict]) -> List[dict]:
    """The dense part of every new task's state: values and the optimizer's per-element state moved
    with their elements; scalar state (Adam's step) and settings taken from the old task 0."""
    values = _unflatten(old, [p["values"] for p in parts])
    optimizer_states = [p.get("optimizer") for p in parts]
    per_element: Dict[str, Dict[str, torch.Tensor]] = {}  # state key -> whole variables
    scalars: Dict[str, Any] = {}
    if optimizer_states[0] is not None:
        keys = {k for state in optimizer_states for entry in state["state"].values() for k in entry}
        for key in sorted(keys):
            flats = []
            for state, part in zip(optimizer_states, parts):
                entries = [state["state"].get(i, {}).get(key) for i in range(len(part["values"]))]
                if any(isinstance(e, torch.Tensor) and e.dim() == 1 and e.numel() == v.numel()
                       for e, v in zip(entries, part["values"])):
                    flats.append([e if e is not None else torch.zeros_like(v) for e, v in zip(entries, part["values"])])
                else:
                    scalars[key] = next((e for e in entries if e is not None), None)
                    flats = None
                    break
            if flats is not None:
                per_element[key] = _unflatten(old, flats)
    out = []
    for task in range(new.num_ps):
        flats = _flatten(new, task, values) if new.on_task(task) else []
        optimizer = None
        if optimizer_states[0] is not None and flats:
            state = {}
            for i in range(len(flats)):
                entry = {k: v for k, v in scalars.items() if v is not None}
                entry.update({k: _flatten(new, task, whole)[i] for k, whole in per_element.items()})
                state[i] = entry
            groups = [{**g, "params": list(range(len(flats)))} for g in optimizer_states[0]["param_groups"]]
            optimizer = {"state": state, "param_groups": groups}
        out.append({"shards": [s.name for s in new.on_task(task)], "values": flats, "optimizer": optimizer})
    return out


# ---- tables
def _rows_of(entry: dict, optimizer: RowOptimizer):
    """(global ids, values, state, updates) of one saved table shard."""
    spec: TableSpec = entry["spec"]
    state = entry["state"]
    store = make_store(spec, entry["shard"], optimizer, None if spec.is_hash else state["values"])
    store.load_state_dict(state)
    ids, values, rows_state = store.export()
    return spec.global_ids(entry["shard"], ids), values, rows_state, int(state["updates"])


def reshard_tables(parts: List[dict], specs: Mapping[str, TableSpec], optimizer: RowOptimizer) -> List[Dict[str, dict]]:
    """Every new task's table states: each saved row routed by the new spec, with its optimizer state
    (hash tables keep their rows; ids seen but not yet admitted start over)."""
    num_new = next(iter(specs.values())).num_shards
    out: List[Dict[str, dict]] = [{} for _ in range(num_new)]
    for name, spec in specs.items():
        saved = [p.get("tables", {}).get(name) for p in parts]
        if any(entry is None for entry in saved):
            raise ParameterServerError(f"the checkpoint has no rows of table {name!r} on some ps task; it was written "
                                       "by another model")
        stores = [make_store(spec, shard, optimizer, None if spec.is_hash else
                             torch.zeros(spec.shard_rows(shard), spec.dim, dtype=spec.dtype)) for shard in range(num_new)]
        for entry in saved:
            if entry["spec"].rows != spec.rows or entry["spec"].dim != spec.dim:
                raise ParameterServerError(f"table {name!r} was saved {entry['spec'].rows}x{entry['spec'].dim}, the model "
                                           f"has it {spec.rows}x{spec.dim}")
            ids, values, state, updates = _rows_of(entry, optimizer)
            shard, local = spec.route(ids)
            for s, store in enumerate(stores):
                mask = shard == s
                store.load_rows(local[mask], values[mask], {k: v[mask] for k, v in state.items()}, updates)
        for s, store in enumerate(stores):
            out[s][name] = {"spec": spec, "shard": s, "state": store.state_dict()}
    return out


def needs_reshard(parts: Mapping[Any, dict], num_ps: int, specs: Mapping[str, TableSpec]) -> bool:
    """Whether the parts were written with another number of ps tasks or another partition of a table."""
    if len(parts) != num_ps:
        return True
    for part in parts.values():
        for name, entry in (part.get("tables") or {}).items():
            if name in specs and entry["spec"] != specs[name]:
                return True
    return False


def reshard(parts: Mapping[Any, dict], old: Layout, new: Layout, specs: Mapping[str, TableSpec],
            optimizer: RowOptimizer) -> Dict[int, dict]:
    """New parts, by new task, from parts written with `old`'s number of ps tasks."""
    ordered = _by_task(parts)
    dense = reshard_dense(old, new, ordered)
    tables = reshard_tables(ordered, specs, optimizer) if specs else [{} for _ in range(new.num_ps)]
    step = max(int(p["global_step"]) for p in ordered)
    out = {}
    for task in range(new.num_ps):
        out[task] = {**dense[task], "tables": tables[task], "global_step": step,
                     "clocks": dict(ordered[0].get("clocks") or {}), "earlier": list(ordered[0].get("earlier") or [])}
    return out
