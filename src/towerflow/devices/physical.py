"""The hardware this process can see: the CPU, each visible CUDA GPU, and Apple's MPS."""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import List, Optional, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class PhysicalDevice:
    """One real device as torch addresses it; logical devices are carved out of these."""

    device_type: str  # "CPU", "GPU" or "MPS"
    index: int  # index among visible devices of this type (CUDA_VISIBLE_DEVICES renumbering applied)
    torch_device: str  # "cpu", "cuda:1", "mps"
    name: str
    memory_bytes: Optional[int] = None
    compute_capability: Optional[Tuple[int, int]] = None
    pci_bus_id: Optional[str] = None

    def describe(self) -> str:
        """TF's device-mapping text: `device: 0, name: Tesla P40, pci bus id: ..., compute capability: 6.1`."""
        parts = [f"device: {self.index}", f"name: {self.name}"]
        if self.pci_bus_id:
            parts.append(f"pci bus id: {self.pci_bus_id}")
        if self.compute_capability:
            parts.append("compute capability: {}.{}".format(*self.compute_capability))
        return ", ".join(parts)


def _host_memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_device() -> PhysicalDevice:
    name = platform.processor() or platform.machine() or "cpu"
    return PhysicalDevice("CPU", 0, "cpu", f"{name} ({os.cpu_count()} cores)", _host_memory_bytes())


def gpu_count() -> int:
    """Visible CUDA GPUs, counted without starting the CUDA runtime (torch asks NVML)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:
        return 0


def cuda_gpus() -> List[PhysicalDevice]:
    """Each visible CUDA GPU. Starts the CUDA runtime when there is one, as TF does when it lists devices."""
    out = []
    for i in range(gpu_count()):
        props = torch.cuda.get_device_properties(i)
        bus = None
        if hasattr(props, "pci_bus_id"):
            bus = f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        out.append(
            PhysicalDevice(
                "GPU", i, f"cuda:{i}", props.name, int(props.total_memory), (props.major, props.minor), bus
            )
        )
    return out


def mps_devices() -> List[PhysicalDevice]:
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return [PhysicalDevice("MPS", 0, "mps", "Apple MPS")]
    return []


def discover() -> List[PhysicalDevice]:
    """Every physical device this process can place work on, CPU first."""
    return [cpu_device(), *cuda_gpus(), *mps_devices()]
