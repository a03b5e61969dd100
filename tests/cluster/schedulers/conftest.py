"""The machine a recorded environment was taken on: what torchrun's `auto`, `cpu` and `gpu` count there."""

from __future__ import annotations

import pytest

from towerflow.cluster.schedulers import nproc


class RecordedMachine(nproc.Machine):
    """A golden case's "machine" ({"cpus": N, "cuda": M}); without one, a CPU-only machine of one core."""

    def __init__(self, cpus: int = 1, cuda: int = 0):
        self._cpus, self._cuda = cpus, cuda

    def cpus(self) -> int:
        return self._cpus

    def cuda_gpus(self):
        return self._cuda or None

    def accelerator(self):
        return ("cuda", self._cuda) if self._cuda else None


@pytest.fixture
def machine_of(monkeypatch):
    """Call with a golden case: torchrun's counts come from its recorded machine, not this one."""
    def use(case):
        monkeypatch.setattr(nproc, "MACHINE", RecordedMachine(**case.get("machine", {})))
    return use
