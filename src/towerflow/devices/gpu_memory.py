"""GPU visibility and memory options (TF's GPUOptions) applied to PyTorch's CUDA runtime.

Visibility must be decided before the CUDA runtime starts, as in TF; memory caps go
through `torch.cuda.set_per_process_memory_fraction`, and `allow_growth=False`
reserves the memory in PyTorch's caching allocator up front so other processes cannot take it.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch

from towerflow import config as _config
from towerflow import library_env as _library_env
from towerflow.devices import physical as _physical
from towerflow.errors import ConfigError

log = logging.getLogger("towerflow.devices")

_ENV = "CUDA_VISIBLE_DEVICES"
_UNREAD = object()
_original_env: object = _UNREAD  # what the user launched us with, read on first need (a task forked from a fork
# server that imported this module gets its own environment after the import)
_reserved: set = set()  # GPUs whose memory we reserved up front (allow_growth=False)
_RESERVE_MARGIN = 256 << 20  # leave room for the CUDA context and cuBLAS workspaces


def _cuda_started() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _launched_env() -> Optional[str]:
    global _original_env
    if _original_env is _UNREAD:
        _original_env = _library_env.value(_ENV)
    return _original_env  # type: ignore[return-value]


def _visible_env(indices: Optional[List[int]]) -> Optional[str]:
    """CUDA_VISIBLE_DEVICES for `indices`, taken relative to what the process was launched with."""
    original = _launched_env()
    if indices is None:
        return original
    if original is None:
        return ",".join(map(str, indices))
    launched = [v.strip() for v in original.split(",") if v.strip()]
    missing = [i for i in indices if i >= len(launched)]
    if missing:
        raise ConfigError(
            f"visible_devices={indices!r}: this process was started with {_ENV}={original!r}, "
            f"which has {len(launched)} GPU(s); indices {missing} do not exist. Use indices below {len(launched)}."
        )
    return ",".join(launched[i] for i in indices)


def _check(old: _config.Config, new: _config.Config) -> None:
    if new.visible_devices == old.visible_devices:
        return
    wanted = _visible_env(new.visible_devices)
    if _cuda_started() and wanted != _library_env.value(_ENV):
        raise ConfigError(
            f"visible_devices={new.visible_devices!r} cannot take effect: the CUDA runtime already started in "
            f"this process (something ran on a GPU or listed GPU properties). Call towerflow.configure(visible_devices=...) "
            f"before any GPU work, or launch with {_ENV}=... in the environment."
        )


def _memory_cap(cfg: _config.Config, index: int, total: int) -> Optional[int]:
    caps = []
    if cfg.gpu_memory_fraction is not None:
        caps.append(int(cfg.gpu_memory_fraction * total))
    limit = cfg.memory_limit.get(index) if isinstance(cfg.memory_limit, dict) else cfg.memory_limit
    if limit is not None:
        caps.append(limit << 20)
    split = (cfg.logical_devices or {}).get(f"GPU:{index}")
    if split and all(split):
        caps.append(sum(split) << 20)
    return min(caps) if caps else None


def _apply(old: _config.Config, new: _config.Config) -> None:
    if new.visible_devices != old.visible_devices:
        wanted = _visible_env(new.visible_devices)
        _library_env.assign(_ENV, wanted)
    memory_keys = ("gpu_memory_fraction", "memory_limit", "allow_growth", "logical_devices", "visible_devices")
    if all(getattr(old, k) == getattr(new, k) for k in memory_keys):
        return
    gpus = _physical.gpu_count()
    if gpus == 0:
        if any(getattr(new, k) not in (None, True) for k in ("gpu_memory_fraction", "memory_limit", "allow_growth")):
            log.info("no GPU visible: the GPU memory options are kept and apply to no device")
        return
    for index in range(gpus):
        total = torch.cuda.get_device_properties(index).total_memory
        cap = _memory_cap(new, index, total)
        torch.cuda.set_per_process_memory_fraction(cap / total if cap else 1.0, index)
        _reserve(index, None if new.allow_growth else (cap or total))


def confine_to(device) -> Optional[int]:
    """Cap this process at logical GPU `device`'s memory limit; the cap in bytes, or None when it has none.

    For a replica process that trains on one logical device of a split GPU: torch has one allocator
    per physical GPU, so TF's per-logical-device limit becomes this process's cap on the card (the
    other logical devices are other processes'). A process that uses several logical devices of one
    GPU keeps the card-wide cap, the sum of their limits (`_memory_cap`).
    """
    if device.device_type != "GPU" or not device.is_split or not device.memory_limit_bytes:
        return None
    index = device.torch_device.index or 0
    total = torch.cuda.get_device_properties(index).total_memory
    cap = min(device.memory_limit_bytes, _memory_cap(_config.current(), index, total) or total)
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    log.info("this process is capped at %d MiB on GPU:%d, the limit of %s", cap >> 20, index, device.short_name)
    return cap


def _reserve(index: int, nbytes: Optional[int]) -> None:
    """Hold `nbytes` in the caching allocator (TF's grab-it-all), or give a previous hold back."""
    if index in _reserved:
        _reserved.discard(index)
        torch.cuda.empty_cache()
    if nbytes is None:
        return
    free, _ = torch.cuda.mem_get_info(index)
    size = max(0, min(nbytes, free) - _RESERVE_MARGIN)
    if size:
        block = torch.empty(size, dtype=torch.uint8, device=f"cuda:{index}")
        del block  # stays reserved in PyTorch's cache, ready for this process's tensors
        _reserved.add(index)
        log.info("reserved %d MiB on GPU:%d up front (allow_growth=False)", size >> 20, index)


_config.on_change(check=_check, apply=_apply)
