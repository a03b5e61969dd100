"""Publications written to Redis (`--publish-to redis://HOST:PORT/DB`), the store users put before online serving.

Keys, for model MODEL and ps task T:

    towerflow:MODEL:TABLE:ID        the publication's number (int64) then the row (float32), little-endian bytes
    towerflow:MODEL:dense:NAME      hash {"v": float32/float64 bytes as the shard's dtype, "dtype", "shape"}
    towerflow:MODEL:ps-T            hash {"seq", "kind", "global_step", "time", "rows", "evicted", "seconds"}: the last publication
                                    announced, written after all its rows

The rows go in pipelined batches (an MSET of `batch_rows` rows each, not in a MULTI: a reader may see part
of a publication's rows, each row whole). A batch's keys and values are made by numpy at once, and redis-py
packs the commands (in C with `hiredis`, which the serving extra installs): about 1 CPU second per million
rows in this process and as much in the server (benchmarks/redis_sink_rows.py). Every row of a table shard lives on one ps task and only that
task writes it, in publication order, so a row's value is always its newest. The numbering goes on from
the `ps-T` key after a restart, as the file log's does. A delta deletes the keys of the hash rows evicted
since the previous publication (DEL, before its rows are written; none of them is among its rows).
"""

from __future__ import annotations

import json
import time
from typing import Dict, Iterable, Optional, Tuple

import numpy as np
import torch

from towerflow.errors import ParameterServerError
from towerflow.redis_url import parse_redis_url
from towerflow.ps.tables.delta_log import DELTA, SNAPSHOT, Publication

PREFIX = "towerflow"


def row_key(model: str, table: str, row_id: int) -> str:
    return f"{PREFIX}:{model}:{table}:{row_id}"


def task_key(model: str, task: int) -> str:
    return f"{PREFIX}:{model}:ps-{task}"


class RedisSink:
    """One ps task's publications of one model, written to Redis (the `DeltaLog` interface)."""

    periodic_snapshots = False  # each key holds its row's newest value: a snapshot would re-write it for nothing

    def __init__(self, url: str, model: str, task: int, batch_rows: int = 4096):
        try:
            import redis
        except ImportError:  # pragma: no cover - the serving extra is missing
            raise ParameterServerError("--publish-to redis://... needs the redis client: pip install 'towerflow[serving]'") from None
        host, port, db = parse_redis_url(url)
        self.client = redis.Redis(host=host, port=port, db=db)
        self.model = model
        self.task = task
        self.batch_rows = batch_rows
        last = self.client.hget(task_key(model, task), "seq")
        self.next_seq = int(last) + 1 if last is not None else 1

    def write(self, kind: str, global_step: int, time_s: float, tables: Iterable[Tuple[str, int, Iterable]],
              dense: Dict[str, torch.Tensor], evicted: Optional[Dict[str, torch.Tensor]] = None) -> Publication:
        if kind not in (SNAPSHOT, DELTA):
            raise ParameterServerError(f"kind={kind!r}: expected {SNAPSHOT!r} or {DELTA!r}")
        started = time.perf_counter()
        seq, rows, gone = self.next_seq, {}, {}
        pipe = self.client.pipeline(transaction=False)
        for name, ids in (evicted or {}).items():
            prefix = f"{PREFIX}:{self.model}:{name}:".encode()
            keys = np.char.add(prefix, ids.detach().cpu().numpy().astype("S")).tolist()
            for start in range(0, len(keys), self.batch_rows):
                pipe.execute_command("DEL", *keys[start:start + self.batch_rows])
            gone[name] = len(keys)
        if gone:
            pipe.execute()
        for name, _dim, chunks in tables:
            written = 0
            prefix = f"{PREFIX}:{self.model}:{name}:".encode()
            for ids, values in chunks:
                for start in range(0, ids.numel(), self.batch_rows):
                    pipe.execute_command("MSET", *_pairs(prefix, ids[start:start + self.batch_rows],
                                                         values[start:start + self.batch_rows], seq))
                    written += min(self.batch_rows, ids.numel() - start)
                pipe.execute()
            rows[name] = written
        for name, value in dense.items():
            pipe.hset(f"{PREFIX}:{self.model}:dense:{name}", mapping={
                "v": value.detach().contiguous().numpy().tobytes(), "dtype": str(value.dtype).replace("torch.", ""),
                "shape": json.dumps(list(value.shape))})
        pipe.execute()
        entry = Publication(seq, kind, int(global_step), float(time_s), {}, rows, None,
                            round(time.perf_counter() - started, 4), {}, gone)
        self.client.hset(task_key(self.model, self.task), mapping={
            "seq": seq, "kind": kind, "global_step": entry.global_step, "time": entry.time, "rows": json.dumps(rows),
            "evicted": json.dumps(gone), "seconds": entry.seconds})
        self.next_seq = seq + 1
        return entry


def encode_row(version: int, vector: torch.Tensor) -> bytes:
    """A row's value: the version (int64) then the vector (float32), little-endian."""
    return np.int64(version).astype("<i8").tobytes() + vector.detach().to(torch.float32).numpy().astype("<f4").tobytes()


def decode_row(value: bytes) -> Tuple[int, torch.Tensor]:
    """(version, vector) of a row's value."""
    version = int(np.frombuffer(value[:8], dtype="<i8")[0])
    return version, torch.from_numpy(np.frombuffer(value[8:], dtype="<f4").copy())


def _pairs(prefix: bytes, ids: torch.Tensor, values: torch.Tensor, version: int) -> list:
    """MSET's arguments for rows: key, value, key, value, ... as bytes, built by numpy for the batch at once (the
    client packs them into the protocol)."""
    n = ids.numel()
    vectors = values.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False)
    width = 8 + vectors.shape[1] * 4
    packed = np.empty((n, width), dtype=np.uint8)
    packed[:, :8] = np.full(n, version, dtype="<i8").view(np.uint8).reshape(n, 8)
    packed[:, 8:] = vectors.view(np.uint8).reshape(n, -1)
    out: list = [None] * (2 * n)
    out[0::2] = np.char.add(prefix, ids.detach().cpu().numpy().astype("S")).tolist()
    out[1::2] = packed.view(f"V{width}").reshape(n).tolist()  # void, not "S": bytes keep their trailing zeros
    return out
