"""Which ps task holds each looked-up row: a batch's unique ids routed to their shards, and its row
gradients cut the same way, so a push sends each ps task exactly the rows it served."""

from __future__ import annotations

import collections
from typing import Dict, Mapping, Tuple

import torch

from towerflow.ps import key_steps
from towerflow.ps.messages import RowPush
from towerflow.ps.tables import TableSpec

# {task: [(table, mask into the table's ids, the ids' keys on that task, packed for the wire)]}
Routing = Dict[int, list]


def route(tables: Mapping[str, TableSpec], ids_by_table: Mapping[str, torch.Tensor]) -> Routing:
    """Where each table's unique ids live: by ps task, the mask of its ids and their keys there."""
    out: Routing = collections.defaultdict(list)
    for name, ids in ids_by_table.items():
        spec = tables[name]
        spec.check_ids(ids)
        shard, local = spec.route(ids)
        for task in range(spec.num_shards):
            mask = shard == task
            out[task].append((name, mask, key_steps.pack(local[mask].to(spec.wire_dtype()))))
    return out


def pushes_by_task(tables: Mapping[str, TableSpec], last_read: Tuple[Mapping[str, torch.Tensor], Routing],
                   grads_by_table) -> Dict[int, RowPush]:
    """Each ps task's part of a step's row gradients ({table: (unique ids, grads)}), routed as the read of
    those ids was (`last_read`: the ids and their routing), or afresh for ids that read did not have."""
    if not grads_by_table:
        return {}
    read, routed = last_read
    if any(read.get(name) is not ids for name, (ids, _) in grads_by_table.items()):  # not the last read's ids
        routed = route(tables, {name: ids for name, (ids, _) in grads_by_table.items()})
    out = {}
    for task, parts in routed.items():
        parts = [p for p in parts if p[0] in grads_by_table]  # tables the loss reached
        grads = tuple(grads_by_table[name][1][mask].to("cpu") for name, mask, _ in parts)
        out[task] = RowPush(tuple(n for n, _, _ in parts), tuple(k for _, _, k in parts), grads)
    return out


def assemble(tables: Mapping[str, TableSpec], parts: Mapping[int, Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Every fixed table whole, from each ps task's shards ({task: {table: rows}}); hash tables are left out."""
    out = {}
    for name, spec in tables.items():
        if spec.is_hash:
            continue
        full = torch.empty(spec.rows, spec.dim, dtype=spec.dtype)
        for task, values in parts.items():
            if name in values:
                full[spec.global_ids(task, torch.arange(values[name].shape[0]))] = values[name]
        out[name] = full
    return out
