"""torchrun (torch.distributed.run): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT.

torchrun does not say where the other nodes' ranks run. On one node (LOCAL_WORLD_SIZE ==
WORLD_SIZE) every rank is on MASTER_ADDR and rank r listens at MASTER_PORT + 1 + r (as
`ClusterSpec.from_torchrun`); across nodes the addresses are gathered at runtime through the
rendezvous at MASTER_ADDR:MASTER_PORT, each rank publishing MASTER_PORT + 1 + its place on its
node (`node_slot`: from RANK, since `--virtual-local-rank` gives every worker LOCAL_RANK=0).
A restarted worker group's TORCHELASTIC_RESTART_COUNT surfaces as `Resolved.restart_count`.
"""

from __future__ import annotations

from typing import Mapping

from towerflow.cluster.schedulers.base import (Ranks, Resolved, Roles, SchedulerResolver, block_addresses, count, node_slot,
                                              text)

_FIX = "torchrun sets it for each worker process; start the script with torchrun"


def torch_ranks(env: Mapping[str, str], fix: str = _FIX) -> Ranks:
    """RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE, all required."""
    return Ranks(
        count(env, "RANK", "this process's rank", required=True, fix=fix),
        count(env, "WORLD_SIZE", "the number of processes", required=True, minimum=1, fix=fix),
        count(env, "LOCAL_RANK", "this process's rank on its node", required=True, fix=fix),
        count(env, "LOCAL_WORLD_SIZE", "the number of processes on this node", required=True, minimum=1, fix=fix),
    )


def master(env: Mapping[str, str], prefix: str = "", fix: str = _FIX) -> tuple:
    """(MASTER_ADDR, MASTER_PORT), or PET_MASTER_ADDR/PORT with prefix 'PET_'."""
    return (text(env, f"{prefix}MASTER_ADDR", "the host of rank 0", fix),
            count(env, f"{prefix}MASTER_PORT", "the port of rank 0's store", required=True, minimum=1, fix=fix))


class TorchrunResolver(SchedulerResolver):
    name = "torchrun"
    reads = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
             "ROLE_RANK", "TORCHELASTIC_")

    def detect(self, env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env

    def resolve(self, env: Mapping[str, str], roles: Roles) -> Resolved:
        ranks = torch_ranks(env)
        addr, port = master(env)
        restarts = count(env, "TORCHELASTIC_RESTART_COUNT", "how many times torchrun restarted the workers") or 0
        base = port + 1
        if ranks.local_world_size == ranks.world_size:
            return self.from_ranks(env, roles, ranks, block_addresses([addr], [ranks.world_size], base),
                                   restart_count=restarts)
        return self.from_ranks(env, roles, ranks, None, base + node_slot(ranks), f"{addr}:{port}", restarts)
