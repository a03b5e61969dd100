"""The NVML boundary: every GPU statistic towerflow shows comes through `query()`.

nvidia-ml-py is an optional extra (`pip install towerflow[gpu]`); tests hand `query()` a fake
module with the same functions, so everything above this file runs on machines without a GPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, List, Optional


class NVMLUnavailable(Exception):
    """Raised when no GPU statistics can be had; the message says why in words a user can act on."""


@dataclasses.dataclass
class GPUProcess:
    pid: int
    user: str
    command: str
    memory_mib: Optional[int]


@dataclasses.dataclass
class GPUStat:
    index: int
    name: str
    uuid: str
    temperature_c: Optional[int]
    utilization_pct: Optional[int]
    memory_used_mib: int
    memory_total_mib: int
    power_w: Optional[int]
    power_limit_w: Optional[int]
    processes: List[GPUProcess]


def _load() -> Any:
    try:
        import pynvml
    except ImportError:
        raise NVMLUnavailable(
            "nvidia-ml-py is not installed (pip install 'towerflow[gpu]' or pip install nvidia-ml-py)"
        ) from None
    return pynvml


def _optional(call, *args):
    """NVML answers 'not supported' for some fields on some boards; show those as absent."""
    try:
        return call(*args)
    except Exception:
        return None


def _memory(nvml: Any, handle: Any) -> Any:
    """Memory as nvidia-smi shows it: NVML's v2 query, whose `used` leaves out what the driver reserves
    (v1 counts it as used: about 600 MiB more on an H200). Drivers or bindings without v2 answer v1."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
        except Exception:
            pass
    return nvml.nvmlDeviceGetMemoryInfo(handle)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _process_owner(pid: int) -> tuple:
    try:
        import pwd

        uid = os.stat(f"/proc/{pid}").st_uid
        user = pwd.getpwuid(uid).pw_name
    except (OSError, KeyError, ImportError):
        user = "?"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip() or "?"
    except OSError:
        command = "?"
    return user, command


def query(nvml: Any = None) -> List[GPUStat]:
    """A snapshot of every GPU NVML can see; raises NVMLUnavailable when there is none to see."""
    nvml = nvml or _load()
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise NVMLUnavailable(f"no NVIDIA driver reachable ({e})") from None
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            raise NVMLUnavailable("the NVIDIA driver reports no GPU")
        stats = []
        for i in range(count):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            memory = _memory(nvml, h)
            utilization = _optional(nvml.nvmlDeviceGetUtilizationRates, h)
            power = _optional(nvml.nvmlDeviceGetPowerUsage, h)
            limit = _optional(nvml.nvmlDeviceGetEnforcedPowerLimit, h)
            processes = []
            for p in _optional(nvml.nvmlDeviceGetComputeRunningProcesses, h) or []:
                used = getattr(p, "usedGpuMemory", None)
                user, command = _process_owner(p.pid)
                processes.append(GPUProcess(p.pid, user, command, used >> 20 if isinstance(used, int) else None))
            stats.append(
                GPUStat(
                    index=i,
                    name=_text(nvml.nvmlDeviceGetName(h)),
                    uuid=_text(_optional(nvml.nvmlDeviceGetUUID, h) or ""),
                    temperature_c=_optional(nvml.nvmlDeviceGetTemperature, h, 0),  # NVML_TEMPERATURE_GPU
                    utilization_pct=utilization.gpu if utilization is not None else None,
                    memory_used_mib=memory.used >> 20,
                    memory_total_mib=memory.total >> 20,
                    power_w=power // 1000 if power is not None else None,
                    power_limit_w=limit // 1000 if limit is not None else None,
                    processes=processes,
                )
            )
        return stats
    finally:
        _optional(nvml.nvmlShutdown)
