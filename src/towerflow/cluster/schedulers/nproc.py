"""torchrun's `--nproc-per-node` values, as a PyTorchJob pod's PET_NPROC_PER_NODE carries them.

The training operator writes the job's `nprocPerNode` unresolved (`auto` unless the job says
otherwise) for torchrun to resolve in the pod. towerflow resolves it as torchrun does
(torch/distributed/run.py, `determine_local_world_size`): a number is itself; `cpu` is the CPUs
this process may run on; `gpu` the visible CUDA GPUs, refused without CUDA as torchrun refuses it;
`auto` the accelerator's devices where torch sees one (CUDA, XPU, MPS, ...), else the CPUs.
Counting needs this machine, so `MACHINE` counts (importing torch only then) and a test replaces it.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Tuple

from towerflow.errors import SchedulerError

WORDS = ("auto", "cpu", "gpu")


class Machine:
    """What torchrun counts on this machine."""

    def cpus(self) -> int:
        """As torch._utils.cpu_count: the CPUs this process may run on (affinity, a container's cpuset)."""
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def cuda_gpus(self) -> Optional[int]:
        """The visible CUDA GPUs; None where CUDA is not available."""
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else None

    def accelerator(self) -> Optional[Tuple[str, int]]:
        """(type, device count) of the accelerator torch uses; None on a machine with none."""
        import torch

        acc = getattr(torch, "accelerator", None)
        if acc is None:  # torch before 2.6: torchrun's `auto` looked at CUDA only
            gpus = self.cuda_gpus()
            return None if gpus is None else ("cuda", gpus)
        return (acc.current_accelerator().type, acc.device_count()) if acc.is_available() else None


MACHINE = Machine()


def nproc_per_node(env: Mapping[str, str], name: str, setting: str) -> Optional[int]:
    """The processes per node that torchrun would start for `env[name]`; None where it is unset.

    `setting` names what the user sets to change it (a job's field), for the errors."""
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    if raw not in WORDS:
        raise SchedulerError(f"{name}={raw!r}: expected the processes per node as torchrun's --nproc-per-node takes "
                             f"them: a number >= 1, or {', '.join(WORDS)} (counted on this machine); set {setting} "
                             "to one of them")
    if raw == "cpu":
        return MACHINE.cpus()
    if raw == "gpu":
        gpus = MACHINE.cuda_gpus()
        if not gpus:
            raise SchedulerError(f"{name}='gpu': torchrun starts one process per CUDA GPU, but this machine has no "
                                 f"CUDA GPU available; set {setting} to a number, or to auto (the GPUs where there "
                                 "are any, else the CPUs) or cpu")
        return gpus
    found = MACHINE.accelerator()
    return found[1] if found is not None else MACHINE.cpus()
