"""`towerflow export` streams a table: a checkpoint whose one ps task holds a 205 MB table exports with the
process's own memory growing by well under the table's bytes (the checkpoint memory-mapped, the rows written
in row groups, the whole table assembled in a file-backed tensor)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from towerflow.ps.layout import plan_layout
from towerflow.ps.tables import TableSpec
from towerflow.ps.tables.row_optimizers import SparseSGD
from towerflow.ps.tables.table_shards import make_store
from towerflow.session.checkpoint import CheckpointManager

pytest.importorskip("pyarrow")
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc (Linux)")]

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
ROWS, DIM = 3_200_000, 16  # 205 MB of float32 on one ps task: a shard read whole would show as that much


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", device="meta")  # the chief's table: on the ps, not here
        self.out = nn.Linear(DIM, 1)


class _SavedOptimizer:
    def __init__(self, parts):
        self.parts = parts

    def state_dict(self):
        return {"global_step": 3, "ps": self.parts}


def _save(run_dir) -> None:
    net = _Net()
    params = {n: p.detach() for n, p in net.named_parameters() if n != "emb.weight"}
    layout = plan_layout(params, 1)
    spec = TableSpec("emb", ROWS, DIM, torch.float32, 1)
    values = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0))
    store = make_store(spec, 0, SparseSGD(lr=0.1), values)
    parts = {0: {"shards": [s.name for s in layout.on_task(0)], "values": [layout.pack(0, params)[d]
                                                                            for d in layout.flat_sizes(0)],
                 "optimizer": None, "tables": {"emb": {"spec": spec, "shard": 0, "state": store.state_dict()}},
                 "global_step": 3, "clocks": {}, "earlier": []}}
    del net.emb._parameters["weight"]
    CheckpointManager(str(run_dir)).save(3, net, _SavedOptimizer(parts))


def test_a_table_is_exported_with_memory_growth_well_under_its_bytes(tmp_path):
    _save(tmp_path / "run")
    table_bytes = ROWS * DIM * 4
    done = subprocess.run([sys.executable, str(HERE / "_export_peak.py"), str(tmp_path / "run"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE)])})
    assert done.returncode == 0, done.stderr
    growth, rows = (int(v) for v in done.stdout.split()[1::2])
    assert rows == ROWS
    assert growth < 0.35 * table_bytes, f"the export's own memory grew by {growth / 2**20:.0f} MB for a " \
                                       f"{table_bytes / 2**20:.0f} MB table"
    print(f"peak anonymous memory growth {growth / 2**20:.0f} MB for a {table_bytes / 2**20:.0f} MB table")
