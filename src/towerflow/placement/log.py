"""The placement log: TF's `log_device_placement` lines, records, and the totals that find ping-pong.

Totals are exact over the whole run; records are a bounded ring (the newest
`MAX_RECORDS`), so a long training run cannot grow memory through logging.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
import threading
from typing import Deque, Dict, Iterator, List, Optional, Tuple

import torch

logger = logging.getLogger("towerflow.placement")
MAX_RECORDS = 100_000


@dataclasses.dataclass(frozen=True)
class PlacementRecord:
    """Where one op ran, what it pulled in from elsewhere, and why it fell back if it did."""

    op: str  # unique node name, e.g. "add_1"
    op_type: str  # e.g. "Add"
    device: str  # full TF name of the device it ran on
    input_devices: Tuple[str, ...] = ()
    bytes_moved: int = 0
    fallback: Optional[str] = None  # why soft placement moved it to the CPU
    module: Optional[str] = None  # qualified name of the nn.Module running it, if any
    requested: Optional[str] = None  # the device the scope asked for, when it differs

    def line(self) -> str:
        """TF's shape, `add: (Add): /job:localhost/replica:0/task:0/device:CPU:0`, plus what moved."""
        text = f"{self.op}: ({self.op_type}): {self.device}"
        extra = []
        if self.bytes_moved:
            extra.append(f"moved {self.bytes_moved} B in")
        if self.fallback:
            extra.append(f"soft placement from {self.requested}: {self.fallback}")
        if self.module:
            extra.append(f"module {self.module}")
        return f"{text} [{'; '.join(extra)}]" if extra else text


@dataclasses.dataclass
class PlacementSummary:
    """Ops per device and bytes moved between devices, over everything recorded since the last reset."""

    ops_per_device: Dict[str, int]
    bytes_moved: int
    host_to_device_bytes: int
    device_to_host_bytes: int
    moves: int
    fallbacks: int

    def __str__(self) -> str:
        lines = ["Placement summary:"]
        for device, n in sorted(self.ops_per_device.items()):
            lines.append(f"  {device}: {n} ops")
        lines.append(
            f"  moved {self.bytes_moved} B in {self.moves} copies "
            f"(host->device {self.host_to_device_bytes} B, device->host {self.device_to_host_bytes} B); "
            f"{self.fallbacks} soft-placement fallbacks"
        )
        return "\n".join(lines)


class PlacementLog:
    """A snapshot of the log: iterable records plus the summary of the whole run."""

    def __init__(self, records: List[PlacementRecord], summary: PlacementSummary):
        self.records = records
        self._summary = summary

    def summary(self) -> PlacementSummary:
        return self._summary

    def __iter__(self) -> Iterator[PlacementRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]

    def __repr__(self) -> str:
        return f"PlacementLog({len(self.records)} records)"


class _Recorder:
    """Process-wide store behind `placement_log()`; all methods are thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._records: Deque[PlacementRecord] = collections.deque(maxlen=MAX_RECORDS)
            self._ops: Dict[str, int] = {}
            self._names: Dict[str, int] = collections.Counter()
            self._bytes = self._h2d = self._d2h = self._moves = self._fallbacks = 0

    def unique_name(self, base: str) -> str:
        with self._lock:
            n = self._names[base]
            self._names[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def count_move(self, src: torch.device, dst: torch.device, nbytes: int) -> None:
        with self._lock:
            self._bytes += nbytes
            self._moves += 1
            if src.type == "cpu" and dst.type != "cpu":
                self._h2d += nbytes
            elif src.type != "cpu" and dst.type == "cpu":
                self._d2h += nbytes

    def count_op(self, device: str, fell_back: bool) -> None:
        with self._lock:
            self._ops[device] = self._ops.get(device, 0) + 1
            self._fallbacks += fell_back

    def add(self, record: PlacementRecord, emit_line: bool) -> None:
        with self._lock:
            self._ops[record.device] = self._ops.get(record.device, 0) + 1
            self._fallbacks += record.fallback is not None
            self._records.append(record)
        if emit_line:
            _ensure_visible()
            logger.info(record.line())

    def snapshot(self, clear: bool = False) -> PlacementLog:
        with self._lock:
            log = PlacementLog(
                list(self._records),
                PlacementSummary(dict(self._ops), self._bytes, self._h2d, self._d2h, self._moves, self._fallbacks),
            )
        if clear:
            self.reset()
        return log


recorder = _Recorder()


def _ensure_visible() -> None:
    """Users who turn the log on expect to see it (TF prints to stderr) even with logging unconfigured."""
    if logger.handlers or logging.getLogger().handlers:
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def placement_log(clear: bool = False) -> PlacementLog:
    """What the placement log holds: records (newest `MAX_RECORDS`) and the run's summary.

    `clear=True` starts a fresh log (and fresh op names) after taking the snapshot.
    """
    return recorder.snapshot(clear=clear)
