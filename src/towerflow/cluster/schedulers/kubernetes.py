"""Kubernetes: a Kubeflow TFJob's TF_CONFIG, or a PyTorchJob's MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE.

TFJob: TF_CONFIG as the training operator writes it ("environment": "cloud", tasks named
`<job>-<type>-<i>.<namespace>.svc:<port>`; the evaluator is not in the cluster). One process per pod.

PyTorchJob: the Master pod is rank 0, Worker pod i rank i+1; the operator names them
`<job>-master-0` (MASTER_ADDR) and `<job>-worker-<i>`. It also sets PET_NPROC_PER_NODE (the job's
`nprocPerNode`, `auto` unless it says otherwise), PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT
for torchrun in the pod, whose children carry RANK/LOCAL_RANK/... of their own. The pod's own
process is the first of the processes torchrun would start there (`nproc.py` counts them as
torchrun does). A task listens at the master port + 1 + its place on its pod. Where MASTER_ADDR does not end in `-master-0` (or the node count is
elastic, `PET_NNODES=1:4`) pods of several nodes gather their addresses at the rendezvous.
"""

from __future__ import annotations

from typing import List, Mapping, Optional

from towerflow.cluster.schedulers.base import (Ranks, Resolved, Roles, SchedulerResolver, block_addresses, count,
                                               node_slot)
from towerflow.cluster.schedulers.nproc import nproc_per_node
from towerflow.cluster.schedulers.tf_config import from_tf_config
from towerflow.cluster.schedulers.torchrun import master, torch_ranks
from towerflow.errors import SchedulerError

_FIX = "the Kubeflow training operator sets it in every PyTorchJob pod"
_MASTER_POD = "-master-0"


class KubernetesResolver(SchedulerResolver):
    name = "kubernetes"
    reads = ("KUBERNETES_SERVICE_HOST", "TF_CONFIG", "PET_", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
             "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_")

    def detect(self, env: Mapping[str, str]) -> bool:
        return "KUBERNETES_SERVICE_HOST" in env and any(
            k in env for k in ("TF_CONFIG", "PET_NNODES", "PET_MASTER_ADDR", "MASTER_ADDR"))

    def resolve(self, env: Mapping[str, str], roles: Roles) -> Resolved:
        if env.get("TF_CONFIG"):
            return from_tf_config(self, env, roles, local_rank=0)
        addr, port = master(env, "PET_" if env.get("PET_MASTER_ADDR") else "", _FIX)
        elastic = ":" in env.get("PET_NNODES", "")
        ranks = self._ranks(env, elastic)
        nodes = ranks.world_size // ranks.local_world_size
        hosts = _pod_hosts(addr, nodes)
        restarts = count(env, "TORCHELASTIC_RESTART_COUNT", "how many times torchrun restarted the workers") or 0
        if hosts is None or elastic:
            return self.from_ranks(env, roles, ranks, None, port + 1 + node_slot(ranks), f"{addr}:{port}", restarts)
        addresses = block_addresses(hosts, [ranks.local_world_size] * nodes, port + 1)
        return self.from_ranks(env, roles, ranks, addresses, restart_count=restarts)

    @staticmethod
    def _ranks(env: Mapping[str, str], elastic: bool) -> Ranks:
        if "LOCAL_RANK" in env:  # a child of torchrun in the pod
            ranks = torch_ranks(env, "torchrun sets it in the pod")
        elif elastic:
            raise SchedulerError(f"PET_NNODES={env['PET_NNODES']!r}: an elastic PyTorchJob's ranks are given by "
                                 "torchrun's rendezvous; resolve from the processes torchrun starts in the pod")
        else:  # the pod's own process: the first of the processes torchrun would start in this pod
            nproc = nproc_per_node(env, "PET_NPROC_PER_NODE", "the PyTorchJob's nprocPerNode") or 1
            node = count(env, "PET_NODE_RANK", "this pod's index") if "PET_NODE_RANK" in env else count(
                env, "RANK", "this pod's rank", required=True, fix=_FIX)
            nodes = count(env, "PET_NNODES", "the number of pods", minimum=1) or count(
                env, "WORLD_SIZE", "the number of pods", required=True, minimum=1, fix=_FIX)
            ranks = Ranks(node * nproc, nodes * nproc, 0, nproc)
        if ranks.world_size % ranks.local_world_size:
            raise SchedulerError(f"WORLD_SIZE={ranks.world_size} is not a multiple of LOCAL_WORLD_SIZE="
                                 f"{ranks.local_world_size}: a PyTorchJob runs the same number of processes in each pod")
        return ranks


def _pod_hosts(addr: str, nodes: int) -> Optional[List[str]]:
    """The pods' names in node order: `<job>-master-0`, `<job>-worker-0`, ...; None when they cannot be known."""
    if nodes == 1:
        return [addr]
    if not addr.endswith(_MASTER_POD):
        return None
    job = addr[: -len(_MASTER_POD)]
    return [addr] + [f"{job}-worker-{i}" for i in range(nodes - 1)]
