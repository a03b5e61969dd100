"""Kubernetes: a Kubeflow TFJob's TF_CONFIG, or a PyTorchJob's MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE.

TFJob: TF_CONFIG as the training operator writes it ("environment": "cloud", tasks named
`<job>-<type>-<i>.<namespace>.svc:<port>`; the evaluator is not in the cluster). One process per pod.

PyTorchJob, as the training operator writes it (pkg/controller.v1/pytorch/envvar.go, master.go,
elastic.go): in a job with a Master replica the Master pod is rank 0, Worker pod i rank i+1, named
`<job>-master-0` (MASTER_ADDR) and `<job>-worker-<i>`; every pod also gets PET_NNODES, PET_NODE_RANK,
PET_MASTER_ADDR/PORT and PET_NPROC_PER_NODE (the job's `nprocPerNode`, `auto` unless it says
otherwise) for torchrun in the pod, whose children carry RANK/LOCAL_RANK/... of their own. The pod's
own process, which no torchrun started, is one task per pod at the operator's pod-level RANK and
WORLD_SIZE, as torch's own `env://` reads them: nothing in the pod would start the other processes
PET_NPROC_PER_NODE asks torchrun for. A task listens at the master port + 1 + its place on its pod. Where MASTER_ADDR does
not end in `-master-0` (or the node count is elastic, `PET_NNODES=1:4`) the addresses are gathered
at the rendezvous: for torchrun's children the store torchrun serves them (their own MASTER_ADDR /
MASTER_PORT; with an elastic policy torchrun meets at PET_RDZV_ENDPOINT, and nothing listens at
PET_MASTER_ADDR), for the pod's own process the master pod.

A job without a Master replica gets no MASTER_ADDR, RANK or WORLD_SIZE; an elastic one gets only
torchrun's rendezvous (PET_RDZV_ENDPOINT, PET_NNODES=min:max): there only torchrun's children have ranks.
"""

from __future__ import annotations

from typing import List, Mapping, Optional

from towerflow.cluster.schedulers.base import (Ranks, Resolved, Roles, SchedulerResolver, block_addresses, count,
                                               node_slot)
from towerflow.cluster.schedulers.tf_config import from_tf_config
from towerflow.cluster.schedulers.torchrun import master, torch_ranks
from towerflow.errors import SchedulerError

_FIX = "the Kubeflow training operator sets it in the pods of a PyTorchJob with a Master replica"
_UNDER_TORCHRUN = ("run the pod's command under torchrun, which reads PET_* and gives each process its rank "
                   "(`torchrun -m towerflow launch train.py`, or `torchrun train.py` calling strategy_from_env())")
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
        elastic = ":" in env.get("PET_NNODES", "")
        child = "LOCAL_RANK" in env  # a child of torchrun in the pod
        if not child:
            _check_pod_process(env, elastic)
        addr, port = master(env, "PET_" if env.get("PET_MASTER_ADDR") else "", _FIX)
        ranks = torch_ranks(env, "torchrun sets it in the pod") if child else _pod_ranks(env)
        if ranks.world_size % ranks.local_world_size:
            raise SchedulerError(f"WORLD_SIZE={ranks.world_size} is not a multiple of LOCAL_WORLD_SIZE="
                                 f"{ranks.local_world_size}: a PyTorchJob runs the same number of processes in each pod")
        nodes = ranks.world_size // ranks.local_world_size
        hosts = _pod_hosts(addr, nodes)
        restarts = count(env, "TORCHELASTIC_RESTART_COUNT", "how many times torchrun restarted the workers") or 0
        if hosts is None or elastic:  # torchrun's children meet at its own store (its MASTER_*), not the master pod
            addr, port = master(env, "", "torchrun sets it in the pod") if child else (addr, port)
            return self.from_ranks(env, roles, ranks, None, port + 1 + node_slot(ranks), f"{addr}:{port}", restarts)
        addresses = block_addresses(hosts, [ranks.local_world_size] * nodes, port + 1)
        return self.from_ranks(env, roles, ranks, addresses, restart_count=restarts)


def _check_pod_process(env: Mapping[str, str], elastic: bool) -> None:
    """Refuse, with the reason, a pod's own process that the operator gave no rank."""
    if not env.get("MASTER_ADDR") and not env.get("PET_MASTER_ADDR"):
        said = ", ".join(f"{k}={env[k]!r}" for k in ("PET_RDZV_ENDPOINT", "PET_NNODES") if env.get(k))
        if elastic or env.get("PET_RDZV_ENDPOINT"):
            raise SchedulerError(
                f"an elastic PyTorchJob without a Master replica ({said}): the training operator sets MASTER_ADDR, "
                "RANK and WORLD_SIZE only in the pods of a job with a Master replica, so this pod's own process has "
                "no rank: torchrun's rendezvous gives the ranks once the pods have met. To place the processes, "
                + _UNDER_TORCHRUN + "; or add a Master replica for a fixed number of pods")
        raise SchedulerError(
            f"MASTER_ADDR is not set in this PyTorchJob pod ({said or 'no PET_* rendezvous either'}): the training "
            "operator sets MASTER_ADDR, RANK and WORLD_SIZE only in the pods of a job with a Master replica, and this "
            "job has neither a Master replica nor an elasticPolicy (whose pods get torchrun's rendezvous), so no "
            "process in it has a rank; add a Master replica to the job")
    if elastic:
        raise SchedulerError(
            f"PET_NNODES={env['PET_NNODES']!r}: an elastic PyTorchJob's ranks are given by torchrun's rendezvous once "
            "the pods have met, not by the operator (its RANK counts pods, not processes); " + _UNDER_TORCHRUN)


def _pod_ranks(env: Mapping[str, str]) -> Ranks:
    """The pod's own process: its pod's one task (PET_NPROC_PER_NODE is torchrun's to act on, and no
    torchrun started this process)."""
    node = count(env, "PET_NODE_RANK", "this pod's index") if "PET_NODE_RANK" in env else count(
        env, "RANK", "this pod's rank", required=True, fix=_FIX)
    nodes = count(env, "PET_NNODES", "the number of pods", minimum=1) or count(
        env, "WORLD_SIZE", "the number of pods", required=True, minimum=1, fix=_FIX)
    return Ranks(node, nodes, 0, 1)


def _pod_hosts(addr: str, nodes: int) -> Optional[List[str]]:
    """The pods' names in node order: `<job>-master-0`, `<job>-worker-0`, ...; None when they cannot be known."""
    if nodes == 1:
        return [addr]
    if not addr.endswith(_MASTER_POD):
        return None
    job = addr[: -len(_MASTER_POD)]
    return [addr] + [f"{job}-worker-{i}" for i in range(nodes - 1)]
