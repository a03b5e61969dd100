"""`RedisRows`: the rows a training job publishes to Redis (`--publish-to redis://...`), looked up by id.

The ps tasks write each row under its own key with the number of the publication that wrote it
(`ps/server/redis_sink.py`); a lookup is one MGET per call. Rows published in one publication become
visible one pipelined batch at a time; `published(task)` says which publication a task announced last.
"""

from __future__ import annotations

import json
from typing import Dict, Optional, Tuple

import torch

from towerflow.ps.server.redis_sink import PREFIX, decode_row, task_key
from towerflow.redis_url import parse_redis_url


class RedisRows:
    """Lookups of published rows in Redis, for one model."""

    def __init__(self, url: str, model: str = "model"):
        import redis

        host, port, db = parse_redis_url(url, "RedisRows")
        self.client = redis.Redis(host=host, port=port, db=db)
        self.model = model

    def lookup(self, table: str, ids: torch.Tensor, dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(rows [n, dim], versions [n]) of `ids`: zeros and version 0 for ids never published."""
        ids = ids.reshape(-1).tolist()
        values = self.client.mget([f"{PREFIX}:{self.model}:{table}:{i}" for i in ids]) if ids else []
        rows = torch.zeros(len(ids), dim)
        versions = torch.zeros(len(ids), dtype=torch.int64)
        for k, value in enumerate(values):
            if value is not None:
                versions[k], rows[k] = decode_row(value)
        return rows, versions

    def published(self, task: int) -> Optional[Dict[str, object]]:
        """The last publication ps task `task` announced (seq, kind, global_step, time, rows, evicted, and the
        seconds its writes took), or None."""
        raw = self.client.hgetall(task_key(self.model, task))
        if not raw:
            return None
        got = {k.decode(): v.decode() for k, v in raw.items()}
        return {"seq": int(got["seq"]), "kind": got["kind"], "global_step": int(got["global_step"]),
                "time": float(got["time"]), "rows": json.loads(got["rows"]), "evicted": json.loads(got.get("evicted", "{}")),
                "seconds": float(got.get("seconds", "nan"))}
