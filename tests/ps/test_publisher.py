"""A ps task's publications (no cluster): a delta holds exactly the rows pushed since the previous one, a snapshot
plus its deltas is the live table bit for bit, a delta applied twice or out of order changes nothing or is refused,
and a publish killed half-way announces nothing and is followed, after a restart, by the next number."""

from __future__ import annotations

import json
import os

import pytest
import torch

from towerflow import _files
from towerflow.errors import ParameterServerError
from towerflow.ps.layout import plan_layout
from towerflow.ps.messages import RowPush, Ticket
from towerflow.ps.policies import AsyncPolicy
from towerflow.ps.server.publisher import Publisher
from towerflow.ps.server.service import ShardService
from towerflow.ps.tables import TableSpec, delta_log, row_files
from towerflow.ps.tables.delta_log import DeltaLog
from towerflow.ps.tables.row_optimizers import SparseAdagrad
from towerflow.ps.tables.table_shards import TableShards
from towerflow.serving import EmbeddingStore, PublicationGapError

pytest.importorskip("pyarrow")

ROWS, DIM, NUM_PS = 50, 4, 2


def _service(task: int, evict_after=None) -> ShardService:
    specs = [TableSpec("emb", ROWS, DIM, torch.float32, NUM_PS, seed=1),
             TableSpec("hashed", None, DIM, torch.float32, NUM_PS, "hash", init_std=0.1, evict_after=evict_after)]
    values = {"w": torch.arange(6.0).reshape(3, 2), "b": torch.ones(3)}
    layout = plan_layout(values, NUM_PS)
    return ShardService(layout.on_task(task), layout.pack(task, values), torch.optim.SGD, {"lr": 0.1}, AsyncPolicy(), 1,
                        TableShards(task, specs, SparseAdagrad(lr=0.5)))


def _push(service: ShardService, emb_keys, hash_ids, step: int) -> None:
    """One worker push of rows (local keys of emb, ids of hashed, read first so that they are admitted)."""
    hash_ids = torch.tensor(hash_ids, dtype=torch.int64)
    if hash_ids.numel():
        service.tables.read(["hashed"], [hash_ids], step)
    emb = torch.tensor(emb_keys, dtype=torch.int64)
    tables, keys, grads = ("emb", "hashed"), (emb, hash_ids), (torch.ones(len(emb), DIM), torch.ones(len(hash_ids), DIM))
    dense = [torch.full_like(f, 0.5) for f in service.flats]
    service.push(0, Ticket(service.coordinator.global_step), dense, None, RowPush(tables, keys, grads))


def _publisher(tmp_path, services, snapshot_every=10):
    return Publisher(lambda: dict(services), lambda model: DeltaLog(str(tmp_path), model, 0), every=3600,
                     snapshot_every=snapshot_every, chunk_rows=7)


def _live(service: ShardService, table: str):
    spec = service.tables.specs[table]
    if spec.is_hash:
        ids, values, _ = service.tables.stores[table].export()
    else:
        values = service.tables.fixed_values(table)
        ids = spec.global_ids(0, torch.arange(values.shape[0]))
    order = torch.argsort(ids)
    return ids[order], values[order].clone()


def test_a_delta_holds_exactly_the_rows_pushed_since_the_previous_publication(tmp_path):
    service = _service(0)
    publisher = _publisher(tmp_path, {"model": service})
    first = publisher.publish()[0]
    assert first.kind == "snapshot" and first.rows["emb"] == 25  # ps 0 of 2 holds every other row of 50
    _push(service, [1, 3], [10, 12], 1)
    _push(service, [3, 7], [12], 2)
    delta = publisher.publish()[0]
    assert (delta.kind, delta.seq, delta.global_step) == ("delta", 2, 2)
    folder = delta_log.task_dir(str(tmp_path), "model", 0)
    ids, values, versions = row_files.read_rows(os.path.join(folder, delta.tables["emb"]))
    assert ids.tolist() == [2, 6, 14]  # local rows 1, 3, 7 of shard 0 of a mod table: global ids 2, 6, 14
    assert torch.equal(values, _live(service, "emb")[1][[1, 3, 7]])
    assert versions.tolist() == [2, 2, 2]
    ids, _, _ = row_files.read_rows(os.path.join(folder, delta.tables["hashed"]))
    assert ids.tolist() == [10, 12]
    empty = publisher.publish()[0]
    assert empty.rows == {"emb": 0, "hashed": 0}  # nothing pushed since


def test_a_snapshot_plus_its_deltas_is_the_live_table_bit_for_bit(tmp_path):
    services = {"model": _service(0)}
    publisher = _publisher(tmp_path, services, snapshot_every=3)
    g = torch.Generator().manual_seed(0)
    for step in range(1, 12):
        _push(services["model"], torch.randint(0, 25, (5,), generator=g).unique().tolist(),
              (torch.randint(0, 30, (4,), generator=g) * 2).unique().tolist(), step)
        publisher.publish()
    kinds = [e.kind for e in delta_log.read_manifest(delta_log.task_dir(str(tmp_path), "model", 0))]
    assert kinds[0] == "snapshot" and "delta" in kinds and kinds.count("snapshot") == 2  # older ones pruned
    store = EmbeddingStore(str(tmp_path))
    assert store.refresh() == len(kinds)
    for table in ("emb", "hashed"):
        ids, values = store.table(table)
        live_ids, live_values = _live(services["model"], table)
        assert torch.equal(ids, live_ids) and torch.equal(values, live_values), table
    dense = store.dense()
    assert all(torch.equal(dense[sp.name].reshape(-1), services["model"].flats[0][sp.offset:sp.offset + sp.numel])
               for sp in services["model"].shards)
    emb = _live(services["model"], "emb")[1]
    assert torch.equal(store.lookup("emb", torch.tensor([0, 1])), torch.cat([emb[:1], torch.zeros(1, DIM)]))  # 1: ps 1


def test_a_delta_applied_twice_changes_nothing_and_one_out_of_order_is_refused(tmp_path):
    service = _service(0)
    publisher = _publisher(tmp_path, {"model": service})
    publisher.publish()
    _push(service, [1], [4], 1)
    second = publisher.publish()[0]
    _push(service, [2], [6], 2)
    third = publisher.publish()[0]
    folder = delta_log.task_dir(str(tmp_path), "model", 0)
    first = delta_log.read_manifest(folder)[0]

    store = EmbeddingStore(str(tmp_path))
    assert store.apply(0, folder, first)
    with pytest.raises(PublicationGapError, match="delta 3 does not follow publication 1"):
        store.apply(0, folder, third)
    assert store.apply(0, folder, second) and store.apply(0, folder, third)
    before = store.table("emb")
    assert not store.apply(0, folder, second)  # applied already: nothing changes
    assert not store.apply(0, folder, first)  # an older snapshot after newer deltas: nothing changes
    after = store.table("emb")
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert torch.equal(after[1], _live(service, "emb")[1])


def test_a_publish_killed_half_way_announces_nothing_and_the_restart_goes_on_with_the_next_number(tmp_path,
                                                                                                     monkeypatch):
    service = _service(0)
    publisher = _publisher(tmp_path, {"model": service})
    publisher.publish()
    _push(service, [1], [4], 1)
    publisher.publish()
    folder = delta_log.task_dir(str(tmp_path), "model", 0)
    real = row_files.write_rows

    def dies_after_one(path, dim, chunks, version=None):
        if path.endswith("hashed.parquet"):
            raise KeyboardInterrupt("killed")  # as a SIGKILL would, between two files of one publication
        return real(path, dim, chunks, version)

    monkeypatch.setattr(row_files, "write_rows", dies_after_one)
    _push(service, [2], [6], 2)
    with pytest.raises(KeyboardInterrupt):
        publisher.publish()
    monkeypatch.setattr(row_files, "write_rows", real)
    announced = json.load(open(os.path.join(folder, _files.PUBLISH_MANIFEST)))["publications"]
    assert [e["seq"] for e in announced] == [1, 2]
    assert os.path.exists(os.path.join(folder, "00000003-delta", "emb.parquet"))  # written, never announced

    restarted = _service(0)  # the ps task's next incarnation: its state restored, a new publisher
    restarted.tables.load_state_dict(service.tables.state_dict())
    again = _publisher(tmp_path, {"model": restarted}).publish()[0]
    assert (again.seq, again.kind) == (3, "snapshot")  # no gap, and a snapshot: its record of changes was lost
    assert sorted(os.listdir(folder)) == ["00000001-snapshot", "00000002-delta", "00000003-snapshot",
                                          _files.PUBLISH_MANIFEST]
    store = EmbeddingStore(str(tmp_path))
    store.refresh()
    assert torch.equal(store.table("emb")[1], _live(restarted, "emb")[1])


def test_the_last_publication_of_a_stopping_ps_task_is_a_delta_even_when_a_snapshot_is_due(tmp_path):
    service = _service(0)
    publisher = _publisher(tmp_path, {"model": service}, snapshot_every=1)
    publisher.publish()
    _push(service, [1], [4], 1)
    publisher.publish()  # a delta
    _push(service, [2], [6], 2)
    publisher.stop(final=True)  # a snapshot would be due; the last one stays small
    kinds = [e.kind for e in delta_log.read_manifest(delta_log.task_dir(str(tmp_path), "model", 0))]
    assert kinds == ["snapshot", "delta", "delta"]


def test_after_a_failed_publication_the_next_one_is_a_snapshot(tmp_path, monkeypatch):
    service = _service(0)
    publisher = _publisher(tmp_path, {"model": service})
    publisher.publish()
    _push(service, [1], [4], 1)
    real = row_files.write_rows

    def disk_full(path, dim, chunks, version=None):
        raise OSError("disk full")

    monkeypatch.setattr(row_files, "write_rows", disk_full)
    with pytest.raises(OSError):
        publisher.publish()  # the rows it took from the record are in no publication
    monkeypatch.setattr(row_files, "write_rows", real)
    again = publisher.publish()[0]
    assert (again.seq, again.kind) == (2, "snapshot")
    store = EmbeddingStore(str(tmp_path))
    store.refresh()
    assert torch.equal(store.table("emb")[1], _live(service, "emb")[1])


def test_a_file_snapshot_comes_once_the_deltas_since_hold_as_many_rows_as_a_snapshot_not_before(tmp_path):
    service = _service(0)  # ps 0 holds 25 rows of emb and, with no hash ids read, no hashed rows: a snapshot is 25
    publisher = _publisher(tmp_path, {"model": service}, snapshot_every=None)
    publisher.publish()
    for step in range(1, 14):  # 5 rows a delta: the deltas since the last snapshot reach 25 rows after 5 of them
        _push(service, [(5 * step + k) % 25 for k in range(5)], [], step)
        publisher.publish()
    entries = delta_log.read_manifest(delta_log.task_dir(str(tmp_path), "model", 0))
    assert [e.rows["emb"] for e in entries if e.kind == "delta"][:2] == [5, 5]
    # 3 snapshots (1, 7, 13) written, the newest 2 kept with the deltas after the older one (keep_snapshots=2)
    assert [(e.seq, e.kind[0]) for e in entries] == [(7, "s"), (8, "d"), (9, "d"), (10, "d"), (11, "d"), (12, "d"),
                                                     (13, "s"), (14, "d")]
    folder = delta_log.task_dir(str(tmp_path), "model", 0)
    assert sorted(os.listdir(folder)) == sorted([_files.publish_entry_dir(e.seq, e.kind) for e in entries]
                                                + [_files.PUBLISH_MANIFEST])  # the older ones' files are gone
    store = EmbeddingStore(str(tmp_path))
    store.refresh()
    live_ids, live_values = _live(service, "emb")
    ids, values = store.table("emb")
    assert torch.equal(ids, live_ids) and torch.equal(values, live_values)


def test_an_explicit_snapshot_every_k_deltas_still_holds(tmp_path):
    service = _service(0)
    publisher = _publisher(tmp_path, {"model": service}, snapshot_every=2)
    publisher.publish()
    for step in range(1, 7):
        _push(service, [step], [], step)  # one row a delta: the volume rule would take no snapshot here
        publisher.publish()
    entries = delta_log.read_manifest(delta_log.task_dir(str(tmp_path), "model", 0))
    assert [(e.seq, e.kind[0]) for e in entries] == [(4, "s"), (5, "d"), (6, "d"), (7, "s")]  # 1 S, 2-3 D: pruned
    with pytest.raises(ParameterServerError, match="snapshot_every=0"):
        _publisher(tmp_path, {"model": service}, snapshot_every=0)


class _KindsSink:
    """A sink like Redis's: each key keeps its newest value, so it asks for no periodic snapshot."""

    periodic_snapshots = False

    def __init__(self):
        self.kinds = []

    def write(self, kind, global_step, time_s, tables, dense, evicted=None):
        rows = {name: sum(ids.numel() for ids, _ in chunks) for name, _dim, chunks in tables}
        self.kinds.append(kind)
        return delta_log.Publication(len(self.kinds), kind, global_step, time_s, {}, rows, None)


def test_a_sink_that_keeps_the_newest_values_gets_a_snapshot_only_first_and_after_a_restore():
    from towerflow.ps.server.redis_sink import RedisSink

    assert RedisSink.periodic_snapshots is False and DeltaLog.periodic_snapshots is True
    service, sink = _service(0), _KindsSink()
    publisher = Publisher(lambda: {"model": service}, lambda model: sink, every=3600, snapshot_every=1)
    publisher.publish()
    for step in range(1, 5):
        _push(service, list(range(25)), [], step)  # whole-table deltas: by rows or by count a file log would snapshot
        publisher.publish()
    service.tables.load_state_dict(service.tables.state_dict())  # restored from a checkpoint
    publisher.publish()
    _push(service, [1], [], 5)
    publisher.publish()
    assert sink.kinds == ["snapshot", "delta", "delta", "delta", "delta", "snapshot", "delta"]


def _evicting_run(publisher, service, steps=12):
    """Hash ids admitted in a moving window, so that older ones are evicted (evict_after=2), id 0 read again every
    third step (evicted, then admitted again, also between two publications); a publication after every other step."""
    publisher.publish()
    for step in range(1, steps + 1):
        _push(service, [step % 25], [0, 100 + 2 * step] if step % 3 == 0 else [100 + 2 * step, 102 + 2 * step], step)
        if step % 2 == 0:
            publisher.publish()
    assert service.tables.stores["hashed"].evicted >= 5  # evictions did happen


def test_a_snapshot_plus_deltas_equal_a_hash_table_with_evictions_exactly(tmp_path):
    service = _service(0, evict_after=2)
    publisher = _publisher(tmp_path, {"model": service})
    _evicting_run(publisher, service)
    folder = delta_log.task_dir(str(tmp_path), "model", 0)
    entries = delta_log.read_manifest(folder)
    with_evictions = [e for e in entries if e.evicted]
    assert with_evictions and all(e.kind == "delta" for e in with_evictions)
    evicted_ever = set()
    for entry in with_evictions:
        gone = row_files.read_ids(os.path.join(folder, entry.evicted["hashed"]))
        rows = row_files.read_rows(os.path.join(folder, entry.tables["hashed"]))[0]
        assert gone.numel() == entry.evicted_rows["hashed"] > 0
        assert not set(gone.tolist()) & set(rows.tolist())  # an id admitted again since goes as a row only
        evicted_ever |= set(gone.tolist())

    store = EmbeddingStore(str(tmp_path))
    store.refresh()
    ids, values = store.table("hashed")
    live_ids, live_values = _live(service, "hashed")
    assert torch.equal(ids, live_ids) and torch.equal(values, live_values)  # no row the live table dropped
    assert 0 in evicted_ever and 0 in ids.tolist()  # evicted, admitted again: held, with its new row
    assert not store.apply(0, folder, with_evictions[0])  # applied already: nothing changes
    again = EmbeddingStore(str(tmp_path))  # each delta applied on its own, an eviction of ids it does not hold too
    for entry in entries:
        again.apply(0, folder, entry)
    assert torch.equal(again.table("hashed")[0], live_ids)


def test_the_redis_sink_deletes_the_keys_of_evicted_hash_rows(tmp_path, redis_url):
    import redis

    from towerflow.ps.server.redis_sink import RedisSink
    from towerflow.serving import RedisRows

    service = _service(0, evict_after=2)
    publisher = Publisher(lambda: {"model": service}, lambda model: RedisSink(redis_url, model, 0), every=3600,
                          chunk_rows=7)
    _evicting_run(publisher, service)
    client = redis.Redis.from_url(redis_url)
    held = sorted(int(k.rsplit(b":", 1)[1]) for k in client.scan_iter(match="towerflow:model:hashed:*"))
    live_ids, live_values = _live(service, "hashed")
    assert held == live_ids.tolist()  # every evicted id's key is gone, every live one is there
    rows, versions = RedisRows(redis_url).lookup("hashed", live_ids, DIM)
    assert torch.equal(rows, live_values) and int(versions.min()) >= 1
