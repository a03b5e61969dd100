"""PET_NPROC_PER_NODE (torchrun's --nproc-per-node in a PyTorchJob pod) counted as torchrun itself counts it."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from torch.distributed.run import determine_local_world_size

from towerflow import taskenv
from towerflow.cluster.schedulers import nproc, resolve
from towerflow.errors import SchedulerError

CASES = {c["name"]: c for c in json.loads((pathlib.Path(__file__).parent / "golden.json").read_text())}
DEFAULT_JOB = "pytorchjob default nprocPerNode=auto on a 2-CPU pod: the pod's own process"


@pytest.mark.parametrize("value", ["1", "3", "auto", "cpu"])
def test_the_count_on_this_machine_is_torchruns(value):
    assert nproc.nproc_per_node({"PET_NPROC_PER_NODE": value}, "PET_NPROC_PER_NODE", "it") == \
        determine_local_world_size(value)


def test_gpu_is_the_cuda_gpus_or_refused_as_torchrun_refuses_it():
    if torch.cuda.is_available():
        assert nproc.nproc_per_node({"N": "gpu"}, "N", "it") == determine_local_world_size("gpu")
        return
    with pytest.raises(ValueError):
        determine_local_world_size("gpu")
    with pytest.raises(SchedulerError, match="N='gpu': torchrun starts one process per CUDA GPU"):
        nproc.nproc_per_node({"N": "gpu"}, "N", "it")


@pytest.mark.parametrize("value", ["two", "0", "-1", "Auto", "1.5"])
def test_values_torchrun_does_not_take_are_named(value):
    with pytest.raises(SchedulerError, match=f"N='{value}': expected the processes per node as torchrun's "
                                             "--nproc-per-node takes them: a number >= 1, or auto, cpu, gpu"):
        nproc.nproc_per_node({"N": value}, "N", "it")


def test_a_default_pytorchjob_pod_resolves_on_this_machine_as_torchrun_would_start_it():
    """The operator's default nprocPerNode (auto) on the real machine: the pod runs torchrun's count per pod."""
    per_pod = determine_local_world_size("auto")
    resolved = resolve(taskenv.scheduler_variables(CASES[DEFAULT_JOB]["env"]))
    assert (resolved.rank, resolved.world_size, resolved.local_world_size) == (2 * per_pod, 3 * per_pod, per_pod)
    assert resolved.address == "pytorch-dist-worker-1:23457" and resolved.port == 23457
