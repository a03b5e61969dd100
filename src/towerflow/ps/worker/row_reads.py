"""A worker's reads of embedding rows from the ps tasks, and the routing its push of their gradients reuses.

A forward's lookups read each table's unique ids from the ps tasks holding them, one call per ps task,
all in flight at once (`rows.route` says which task holds which id). The push after the backward sends
each task exactly the rows it served, so the last read's routing is kept for it.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from towerflow.ps import key_steps
from towerflow.ps.messages import Endpoints, RowRead
from towerflow.ps.tables import TableSpec
from towerflow.ps.worker import rows as _rows
from towerflow.ps.worker.calls import PSCalls
from towerflow.ps.worker.counters import StepCounters


class RowReader:
    """Row reads of one worker: numbered (a read sent again after a lost ps keeps its number), their routing kept."""

    def __init__(self, calls: PSCalls, counters: StepCounters, worker: int, device: torch.device):
        self.calls, self.counters, self.worker, self.device = calls, counters, worker, device
        self.tables: Dict[str, TableSpec] = {}
        self.reads = 0  # read_rows calls answered (RowRead.number)
        self._last = ({}, {})  # (ids by table, their routing) of the last read

    def read(self, ids_by_table: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The rows of every table's unique ids, one call per ps task (all in flight at once)."""
        routed = _rows.route(self.tables, ids_by_table)
        self._last = (ids_by_table, routed)
        calls = [(ch, routed[ch.task], self.calls.call(ch, Endpoints.read_rows, RowRead(
            self.worker, tuple(n for n, _, _ in routed[ch.task]), tuple(k for _, _, k in routed[ch.task]), self.reads + 1)))
            for ch in self.calls.channels if routed.get(ch.task)]
        out = {name: torch.empty(ids.numel(), self.tables[name].dim, dtype=self.tables[name].dtype)
               for name, ids in ids_by_table.items()}
        for ch, parts, future in calls:
            rows = self.calls.wait(ch, future)
            for (name, mask, keys), r in zip(parts, rows):
                out[name][mask] = r
                self.counters.pulled(ch.task, key_steps.nbytes(keys) + r.numel() * r.element_size())
        self.reads += 1
        if self.device.type != "cpu":
            out = {name: r.to(self.device, non_blocking=True) for name, r in out.items()}
        return out

    def pushes_by_task(self, row_grads: Optional[Mapping]) -> Dict[int, object]:
        """The row gradients of the last read, cut by the ps task that served each row."""
        return _rows.pushes_by_task(self.tables, self._last, row_grads)
