"""A ps task's lines in `<logdir>/metrics.jsonl`: what it applied, dropped and holds, twice a second.

Workers and the chief record their own view (`MonitoredTrainingSession`); the ps is where the
global step, the dropped stale pushes and the table rows are, so it records them itself:
pushes/s, pulls/s and updates/s since its previous record, the gradients it holds (sync) and
dropped (stale), the staleness histogram, and with sparse tables their rows. `towerflow top`
shows them and `towerflow report` plots them. One record per model per interval, a `start`
event when it starts serving and an `end` event with the final counts.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Optional

from towerflow.monitoring.metrics import EVENT_END, EVENT_START, MetricsWriter


def summary(metrics: dict) -> dict:
    """The fields a ps record carries, from a `ShardService.metrics()` (totals since it started)."""
    tables = metrics.get("tables") or {}
    out = {
        "role": "ps",
        "updates": metrics["applied_updates"],
        "updates_per_sec": round(metrics["updates_per_s"], 3),
        "dropped_stale": metrics["dropped_stale"],
        "staleness": metrics["staleness_histogram"],
        "bytes_pushed": sum(metrics["bytes_pushed_by_worker"].values()),
        "bytes_pulled": sum(metrics["bytes_pulled_by_worker"].values()),
        "pushes": sum(metrics.get("pushes_by_worker", {}).values()),
        "held": len(metrics.get("held_from", ())),
    }
    if "pulls" in metrics:
        out["pulls"] = metrics["pulls"]
    if tables:
        for key in ("rows", "admitted", "evicted"):
            out[key] = sum(int(t.get(key, 0)) for t in tables.values())
        out["table_rows"] = {name: int(t.get("rows", 0)) for name, t in tables.items()}
    replication = metrics.get("replication")
    if replication:  # --ps-replicas 2: where this task's part is mirrored, and how far behind the acks are
        out.update(replica_backup=replication["backup"], replica_lag=replication["lag"],
                   replica_degraded=replication["degraded"], replica_ops=replication["ops_forwarded"])
    return out


class _Rates:
    """Per model: pushes/s, pulls/s and updates/s since the previous record (not since the start)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._last: Dict[str, tuple] = {}

    def __call__(self, model: str, fields: dict) -> dict:
        now = self.clock()
        counts = {k: fields.get(k) for k in ("pushes", "pulls", "updates")}
        before = self._last.get(model)
        self._last[model] = (now, counts)
        if before is None or now <= before[0]:
            return {}
        secs = now - before[0]
        return {f"{k}_per_sec": round((v - before[1][k]) / secs, 2) for k, v in counts.items()
                if v is not None and before[1].get(k) is not None}


class PSRecorder:
    """Writes every served model's summary to metrics.jsonl every `interval` s, in a daemon thread."""

    def __init__(self, logdir: str, task: str, services: Callable[[], Dict[str, object]], interval: float = 0.5,
                 restarts: int = 0):
        self.writer = MetricsWriter(logdir, task, role="ps", device="cpu", tensorboard=True)
        self.services = services
        self.interval = interval
        self.restarts = restarts  # this ps task's incarnation, for its start record
        self._rates = _Rates()
        self._seen: Dict[str, object] = {}  # the models served so far: the final record outlives their shutdown
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def record(self, final: bool = False) -> None:
        """One record per model; the final one carries the totals but no rates (the idle tail after training)."""
        self._seen.update(self.services())
        for model, service in list(self._seen.items()):
            m = service.metrics()
            fields = summary(m)
            if not final:
                fields.update(self._rates(model, fields))
            self.writer.write(m["global_step"], model=model, **fields)

    def start(self) -> "PSRecorder":
        self.writer.write(0, event=EVENT_START, restarts=self.restarts)

        def loop():
            while not self._stop.wait(self.interval):
                self.record()

        self._thread = threading.Thread(target=loop, name="towerflow-ps-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """The last record (the final counts) as the `end` event, then close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 1)
        self.record(final=True)
        step = max((s.metrics()["global_step"] for s in self._seen.values()), default=0)
        self.writer.write(step, event=EVENT_END)
        self.writer.close()
