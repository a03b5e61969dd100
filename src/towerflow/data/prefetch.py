"""Prefetch to device: the next batch crosses host->device while the current one computes.

TF's `prefetch_to_device`, the host-to-device input flow done well: host batches sit in
pinned memory, the copy runs on a side CUDA stream with `non_blocking=True`, and the compute
stream waits on it only when the batch is consumed. Copies are counted in the placement log
(bytes host->device) whenever the log is on. On a CPU device there is nothing to copy.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch

from towerflow import config as _config
from towerflow.placement import log as _log


def _map_tensors(batch: Any, fn) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        out = [_map_tensors(b, fn) for b in batch]
        return type(batch)(out) if not hasattr(batch, "_fields") else type(batch)(*out)
    if isinstance(batch, dict):
        return {k: _map_tensors(v, fn) for k, v in batch.items()}
    return batch


def _count_copy(t: torch.Tensor, device: torch.device, device_name: str) -> None:
    mode = _config.current().log_device_placement
    if not mode:
        return
    nbytes = t.numel() * t.element_size()
    _log.recorder.count_move(t.device, device, nbytes)
    record = _log.PlacementRecord(
        _log.recorder.unique_name("prefetch_to_device"), "MemcpyHtoD", device_name, ("/device:CPU:0",), nbytes
    )
    _log.recorder.add(record, emit_line=mode is True)


def copy_to_device(batch: Any, device: torch.device, device_name: str = "", non_blocking: bool = False) -> Any:
    """`batch` with every tensor on `device`; each real copy is counted in the placement log."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        _count_copy(t, device, device_name or str(device))
        return t.to(device, non_blocking=non_blocking)

    return _map_tensors(batch, move)


class DevicePrefetcher:
    """Iterates host batches and yields them on `device`, one copy always in flight ahead."""

    def __init__(self, batches: Iterable[Any], device: torch.device, device_name: str = "", pin_memory: bool = True):
        self.batches = batches
        self.device = device
        self.device_name = device_name or str(device)
        self.pin_memory = pin_memory and device.type == "cuda"

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            for batch in self.batches:
                yield copy_to_device(batch, self.device, self.device_name)
            return
        stream = torch.cuda.Stream(device=self.device)
        it = iter(self.batches)
        nxt = self._start_copy(it, stream)
        while nxt is not None:
            current = nxt
            torch.cuda.current_stream(self.device).wait_stream(stream)
            _map_tensors(current, lambda t: t.record_stream(torch.cuda.current_stream(self.device)) or t)
            nxt = self._start_copy(it, stream)  # the next copy overlaps the caller's compute on `current`
            yield current

    def _start_copy(self, it: Iterator[Any], stream: "torch.cuda.Stream") -> Optional[Any]:
        try:
            host = next(it)
        except StopIteration:
            return None
        if self.pin_memory:
            host = _map_tensors(host, lambda t: t if t.is_pinned() else t.pin_memory())
        with torch.cuda.stream(stream):
            return copy_to_device(host, self.device, self.device_name, non_blocking=True)
