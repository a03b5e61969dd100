"""A ps task's tables under the update policies: what happens to a push's rows (no cluster)."""

from __future__ import annotations

import torch

from towerflow.ps.layout import plan_layout
from towerflow.ps.messages import RowPush
from towerflow.ps.messages import Ticket
from towerflow.ps.policies import SyncPolicy
from towerflow.ps.server.service import ShardService
from towerflow.ps.tables import TableSpec
from towerflow.ps.tables.row_optimizers import SparseAdagrad
from towerflow.ps.tables.table_shards import TableShards


def test_a_stale_sync_push_drops_its_rows_and_a_held_one_waits_for_the_update():
    """Sync with one backup (1 of 2 per update): the first push of a step is applied with its rows; the
    other worker's push of the same step is then stale and dropped, rows included."""
    spec = TableSpec("t", 8, 2, torch.float32, 1, seed=2)
    layout = plan_layout({"w": torch.zeros(3)}, 1)
    service = ShardService(layout.on_task(0), layout.pack(0, {"w": torch.zeros(3)}), torch.optim.SGD, {"lr": 1.0},
                           SyncPolicy(1, 2), 2, TableShards(0, [spec], SparseAdagrad(lr=1.0)))
    before = service.tables.stores["t"].values.clone()
    rows = lambda ids: RowPush(("t",), (torch.tensor(ids, dtype=torch.int32),), (torch.ones(len(ids), 2),))  # noqa: E731
    applied = service.push(0, Ticket(0), [torch.ones(3)], None, rows([1, 2]))
    dropped = service.push(1, Ticket(0), [torch.ones(3)], None, rows([5]))
    after = service.tables.stores["t"].values
    assert (applied.kind, dropped.kind) == ("applied", "dropped")
    assert not torch.equal(after[[1, 2]], before[[1, 2]]) and torch.equal(after[5], before[5])
    assert torch.equal(after[[0, 3, 4, 6, 7]], before[[0, 3, 4, 6, 7]])  # only the applied push's rows moved
