"""One replica on one device: what `python script.py` gets with no cluster around it."""

from __future__ import annotations

from typing import Optional

import torch

from towerflow.strategies._devices import default_device, resolve_device
from towerflow.taskenv import TaskContext
from towerflow.strategies._local_tables import LocalTablesStrategy
from towerflow.strategies.base import task_context


class OneDeviceStrategy(LocalTablesStrategy):
    """TF's `OneDeviceStrategy`: everything on `device` (default: the first GPU, else the CPU)."""

    name = "one_device"

    def __init__(self, device: Optional[str] = None, variables_on: str = "device", mixed_precision: Optional[str] = None,
                 context: Optional[TaskContext] = None):
        context = task_context(context)
        torch_device, name = resolve_device(device) if device is not None else default_device()
        super().__init__(torch_device, name, variables_on=variables_on, mixed_precision=mixed_precision,
                         context=context)
        if torch_device.type == "cuda":
            torch.cuda.set_device(torch_device)
