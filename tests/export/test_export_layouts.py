"""`export_run` on checkpoints of every layout, built here as the ps tasks save them: the exported state_dict
holds the model's values whole, the Parquet files each table's rows, and exports from 1, 2 and 3 ps tasks
agree; an export that fails half-way leaves nothing under the target's name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from towerflow import _files
from towerflow.errors import CheckpointError
from towerflow.export import export_run, read_export
from towerflow.export.hash_lookup import HashTableLookup
from towerflow.ps.layout import plan_layout
from towerflow.ps.tables import TableSpec, row_files
from towerflow.ps.tables.row_optimizers import SparseSGD
from towerflow.ps.tables.table_shards import make_store
from towerflow.session.checkpoint import CheckpointManager

pytest.importorskip("pyarrow")

ROWS, DIM = 37, 4
HASH_IDS = torch.tensor([5, -3, 2 ** 40, 17, 8, 123456789], dtype=torch.int64)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.dense = nn.Linear(DIM, 6)
        self.out = nn.Linear(6, 1)
        self.register_buffer("scale", torch.tensor([2.0]))


class _SavedOptimizer:
    """What PSOptimizer.state_dict() returns, for CheckpointManager.save."""

    def __init__(self, parts):
        self.parts = parts

    def state_dict(self):
        return {"global_step": 7, "ps": self.parts}


def _truth():
    torch.manual_seed(0)
    net = Net()
    hashed = torch.randn(len(HASH_IDS), DIM)
    return net, hashed


def _save(run_dir, num_ps, placement="round_robin", partition=None, partition_strategy="mod", with_hash=True):
    """A checkpoint as `num_ps` ps tasks write it: dense shards in flat buffers, table shards with their specs."""
    net, hashed = _truth()
    emb = net.emb.weight.detach().clone()
    params = {n: p.detach() for n, p in net.named_parameters() if n != "emb.weight"}
    layout = plan_layout(params, num_ps, placement, partition)
    optimizer = SparseSGD(lr=0.1)
    specs = [TableSpec("emb", ROWS, DIM, torch.float32, num_ps, partition_strategy)]
    if with_hash:
        specs.append(TableSpec("hashed", None, DIM, torch.float32, num_ps, "hash"))
    parts = {}
    for task in range(num_ps):
        packed = layout.pack(task, params)
        tables = {}
        for spec in specs:
            if spec.is_hash:
                shard_of, _ = spec.route(HASH_IDS)
                store = make_store(spec, task, optimizer)
                mine = shard_of == task
                store.load_rows(HASH_IDS[mine], hashed[mine], {})
            else:
                shard_of, local = spec.route(torch.arange(ROWS))
                values = torch.zeros(spec.shard_rows(task), DIM)
                values[local[shard_of == task]] = emb[shard_of == task]
                store = make_store(spec, task, optimizer, values)
            tables[spec.name] = {"spec": spec, "shard": task, "state": store.state_dict()}
        parts[task] = {"shards": [s.name for s in layout.on_task(task)], "values": [packed[d] for d in layout.flat_sizes(task)],
                       "optimizer": None, "tables": tables, "global_step": 7, "clocks": {}, "earlier": []}
    chief = Net()  # the chief's model: stale dense values, tables on the meta device (not in its state)
    with torch.no_grad():
        for p in chief.parameters():
            p.zero_()
    del chief.emb._parameters["weight"]
    CheckpointManager(str(run_dir)).save(7, chief, _SavedOptimizer(parts))
    return net, hashed


LAYOUTS = [
    pytest.param(1, "round_robin", None, "mod", id="1ps"),
    pytest.param(2, "round_robin", None, "mod", id="2ps-round-robin-mod"),
    pytest.param(3, "greedy", None, "div", id="3ps-greedy-div"),
    pytest.param(3, "round_robin", 16, "mod", id="3ps-row-sharded-dense"),
    pytest.param(2, "round_robin", {"dense.weight": 2, "out.weight": 1}, "div", id="2ps-partition-map"),
]


@pytest.mark.parametrize("num_ps,placement,partition,partition_strategy", LAYOUTS)
def test_the_export_loads_into_the_plain_model_with_the_values_the_ps_tasks_held(tmp_path, num_ps, placement, partition,
                                                                                  partition_strategy):
    net, hashed = _save(tmp_path / "run", num_ps, placement, partition, partition_strategy)
    info = export_run(str(tmp_path / "run"), str(tmp_path / "out"))

    plain = Net()
    plain.load_state_dict(torch.load(info.model_file))  # strict: every key, nothing more
    for (name, got), want in zip(plain.state_dict().items(), net.state_dict().values()):
        assert torch.equal(got, want), name
    lookup = HashTableLookup.load(info.out, "hashed", mode=None)
    assert torch.equal(lookup(HASH_IDS), hashed)
    assert torch.equal(lookup(torch.tensor([4, 99])), torch.zeros(2, DIM))  # ids it does not hold read zeros
    assert info.step == 7 and info.num_ps == num_ps


@pytest.mark.parametrize("num_ps,placement,partition,partition_strategy", LAYOUTS)
def test_each_table_is_written_as_parquet_id_vector_rows_one_file_per_shard(tmp_path, num_ps, placement, partition,
                                                                             partition_strategy):
    net, hashed = _save(tmp_path / "run", num_ps, placement, partition, partition_strategy)
    info = export_run(str(tmp_path / "run"), str(tmp_path / "out"), chunk_rows=5)
    rows = {}
    for name in ("emb", "hashed"):
        assert len(info.tables[name]["files"]) == num_ps
        parts = [row_files.read_rows(os.path.join(info.out, f)) for f in info.tables[name]["files"]]
        ids = torch.cat([p[0] for p in parts])
        values = torch.cat([p[1] for p in parts])
        order = torch.argsort(ids)
        rows[name] = ids[order], values[order]
    assert torch.equal(rows["emb"][0], torch.arange(ROWS))
    assert torch.equal(rows["emb"][1], net.emb.weight.detach())
    order = torch.argsort(HASH_IDS)
    assert torch.equal(rows["hashed"][0], HASH_IDS[order])
    assert torch.equal(rows["hashed"][1], hashed[order])


def test_exports_from_one_two_and_three_ps_tasks_hold_the_same_tables(tmp_path):
    exported = []
    for num_ps in (1, 2, 3):
        _save(tmp_path / f"run{num_ps}", num_ps)
        info = export_run(str(tmp_path / f"run{num_ps}"), str(tmp_path / f"out{num_ps}"))
        exported.append((torch.load(info.model_file), torch.load(os.path.join(info.out, _files.EXPORT_HASH_TABLES))))
    for state, hashed in exported[1:]:
        assert state.keys() == exported[0][0].keys()
        assert all(torch.equal(state[k], exported[0][0][k]) for k in state)
        assert all(torch.equal(hashed["hashed"][k], exported[0][1]["hashed"][k]) for k in ("ids", "weight"))


def test_an_export_that_fails_half_way_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    _save(tmp_path / "run", 2)
    first = export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    before = torch.load(first.model_file)

    def broken(path, dim, chunks, version=None):
        raise OSError("disk full")

    monkeypatch.setattr(row_files, "write_rows", broken)
    with pytest.raises(OSError, match="disk full"):
        export_run(str(tmp_path / "run"), str(tmp_path / "out"), overwrite=True)
    with pytest.raises(OSError, match="disk full"):
        export_run(str(tmp_path / "run"), str(tmp_path / "fresh"))
    assert not (tmp_path / "fresh").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no partial folder left behind
    kept = read_export(str(tmp_path / "out"))
    after = torch.load(kept.model_file)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_folder_without_its_manifest_is_not_taken_for_an_export(tmp_path):
    _save(tmp_path / "run", 2)
    info = export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    os.unlink(os.path.join(info.out, _files.EXPORT_MANIFEST))
    with pytest.raises(CheckpointError, match="not a complete export"):
        read_export(info.out)


def test_an_existing_export_is_replaced_only_when_asked(tmp_path):
    _save(tmp_path / "run", 2)
    export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    with pytest.raises(CheckpointError, match="--overwrite"):
        export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="holds other files"):
        export_run(str(tmp_path / "run"), str(tmp_path / "other"))
    assert export_run(str(tmp_path / "run"), str(tmp_path / "out"), overwrite=True).step == 7


def test_a_named_step_that_is_not_there_is_refused_with_the_steps_there_are(tmp_path):
    _save(tmp_path / "run", 2)
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 9; it has steps \[7\]"):
        export_run(str(tmp_path / "run"), str(tmp_path / "out"), step=9)
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        export_run(str(tmp_path / "empty"), str(tmp_path / "out"))


def test_the_manifest_names_every_file_and_the_table_shapes(tmp_path):
    _save(tmp_path / "run", 3)
    info = export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    with open(os.path.join(info.out, _files.EXPORT_MANIFEST)) as f:
        manifest = json.load(f)
    assert manifest["tables"]["emb"]["rows"] == ROWS and manifest["tables"]["emb"]["state_dict_key"] == "emb.weight"
    assert manifest["tables"]["hashed"]["rows"] == len(HASH_IDS) and manifest["tables"]["hashed"]["kind"] == "hash"
    assert (tmp_path / "out" / _files.EXPORT_HASH_LOOKUP).read_text().count("import towerflow") == 0


def test_a_checkpoint_without_parameter_servers_exports_the_model_as_saved(tmp_path):
    net, _ = _truth()
    CheckpointManager(str(tmp_path / "run")).save(3, net, None)
    info = export_run(str(tmp_path / "run"), str(tmp_path / "out"))
    plain = Net()
    plain.load_state_dict(torch.load(info.model_file))
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), net.state_dict().values()))
    assert info.num_ps == 0 and info.tables == {}
