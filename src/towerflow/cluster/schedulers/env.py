"""torch.distributed's `env://` contract alone: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.

What Ray Train, Azure ML and hand-written launchers set, with no mark of torchrun or of a
scheduler of their own (LOCAL_RANK / LOCAL_WORLD_SIZE where they give them). It is last in
detection order, so a scheduler that sets these variables too and marks its own wins. Detected
where RANK or WORLD_SIZE is set, except a world of one without MASTER_ADDR or MASTER_PORT: that is
a plain process, as `strategy_from_env()` reads it.

The ranks are on one host when LOCAL_WORLD_SIZE == WORLD_SIZE, or when LOCAL_WORLD_SIZE is unset
(the reading `strategy_from_env()` makes too): rank r at MASTER_ADDR:MASTER_PORT + 1 + r, as
`ClusterSpec.from_torchrun`. Across hosts (LOCAL_WORLD_SIZE < WORLD_SIZE) the addresses are
gathered at the rendezvous MASTER_ADDR:MASTER_PORT.
"""

from __future__ import annotations

from typing import Mapping

from towerflow.cluster.schedulers.base import (Ranks, Resolved, Roles, SchedulerResolver, block_addresses, count,
                                               node_slot)
from towerflow.cluster.schedulers.torchrun import master
from towerflow.errors import SchedulerError

_FIX = ("torch.distributed's env:// contract needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in every process "
        "(torchrun and towerflow launch set them all); set the missing ones, or unset RANK and WORLD_SIZE for a "
        "plain process")


class EnvResolver(SchedulerResolver):
    name = "env"
    reads = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    def detect(self, env: Mapping[str, str]) -> bool:
        if not (env.get("RANK") or env.get("WORLD_SIZE")):
            return False
        alone = (env.get("WORLD_SIZE") or "1").strip() == "1"
        return not alone or bool(env.get("MASTER_ADDR") or env.get("MASTER_PORT"))

    def resolve(self, env: Mapping[str, str], roles: Roles) -> Resolved:
        rank = count(env, "RANK", "this process's rank", required=True, fix=_FIX)
        world = count(env, "WORLD_SIZE", "the number of processes", required=True, minimum=1, fix=_FIX)
        addr, port = master(env, fix=_FIX)
        local_world = count(env, "LOCAL_WORLD_SIZE", "the number of processes on this host", minimum=1) or world
        local = count(env, "LOCAL_RANK", "this process's rank on its host")
        if local_world > world:
            raise SchedulerError(f"LOCAL_WORLD_SIZE={local_world} with WORLD_SIZE={world}: expected at most WORLD_SIZE "
                                 "processes on one host")
        ranks = Ranks(rank, world, rank if local is None and local_world == world else local, local_world)
        if local_world == world:
            return self.from_ranks(env, roles, ranks, block_addresses([addr], [world], port + 1))
        return self.from_ranks(env, roles, ranks, None, port + 1 + node_slot(ranks), f"{addr}:{port}")
