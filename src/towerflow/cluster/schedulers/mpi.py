"""Open MPI's `mpirun` (OMPI_COMM_WORLD_*) and other PMI launchers (PMI_RANK / PMI_SIZE, PMIX_RANK).

One rank's environment does not say where the other ranks run. A job on one node
(OMPI_COMM_WORLD_LOCAL_SIZE == OMPI_COMM_WORLD_SIZE) is resolved to 127.0.0.1, rank r at
port MASTER_PORT + 1 + r (MASTER_PORT unset: 29500, torch's default). Across nodes the
addresses are gathered at runtime through a rendezvous at MASTER_ADDR:MASTER_PORT, so
MASTER_ADDR is required then (`mpirun -x MASTER_ADDR=<rank 0's host> ...`). No mpi4py.
"""

from __future__ import annotations

from typing import Mapping

from towerflow.cluster.schedulers.base import Ranks, Resolved, Roles, SchedulerResolver, block_addresses, count
from towerflow.errors import SchedulerError

DEFAULT_PORT = 29500
_FIX = "mpirun sets it for every rank; start the script with mpirun"


class MPIResolver(SchedulerResolver):
    name = "mpi"
    reads = ("OMPI_COMM_WORLD_", "PMI_RANK", "PMI_SIZE", "PMIX_RANK", "MASTER_ADDR", "MASTER_PORT")

    def detect(self, env: Mapping[str, str]) -> bool:
        # srun --mpi=pmi2/pmix sets PMI_*/PMIX_* too: those tasks are Slurm's (it knows the hosts)
        return "OMPI_COMM_WORLD_RANK" in env or (("PMI_RANK" in env or "PMIX_RANK" in env) and "SLURM_PROCID" not in env)

    def resolve(self, env: Mapping[str, str], roles: Roles) -> Resolved:
        if not any(v in env for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")):
            raise SchedulerError(f"none of OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK is set: they give this process's "
                                 f"rank; {_FIX}")
        ompi = "OMPI_COMM_WORLD_RANK" in env
        rank_var = "OMPI_COMM_WORLD_RANK" if ompi else ("PMI_RANK" if "PMI_RANK" in env else "PMIX_RANK")
        size_var = "OMPI_COMM_WORLD_SIZE" if ompi else "PMI_SIZE"
        size = count(env, size_var, "the number of ranks", required=True, minimum=1, fix=_FIX)
        local = count(env, "OMPI_COMM_WORLD_LOCAL_RANK", "this rank's index on its node")
        local_size = count(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "the number of ranks on this node", minimum=1)
        ranks = Ranks(count(env, rank_var, "this process's rank", required=True, fix=_FIX), size, local, local_size)
        return place_without_hosts(self, env, roles, ranks, rank_var, "an MPI job",
                                   "`mpirun -x MASTER_ADDR=<rank 0's host> [-x MASTER_PORT=<port>] ...`")


def place_without_hosts(resolver: SchedulerResolver, env: Mapping[str, str], roles: Roles, ranks: Ranks,
                        rank_var: str, job: str, start_with: str) -> Resolved:
    """Ranks whose environment names no hosts: one node's on 127.0.0.1 (rank r at MASTER_PORT + 1 + r), else
    gathered at MASTER_ADDR:MASTER_PORT, which is then required (`start_with`: the launcher's way to set it)."""
    size, local, local_size = ranks.world_size, ranks.local_rank, ranks.local_world_size
    port = count(env, "MASTER_PORT", "the rendezvous port", minimum=1) or DEFAULT_PORT
    if size == 1 or local_size == size:  # one node: every rank on this host
        ranks = Ranks(ranks.rank, size, ranks.rank, size)
        return resolver.from_ranks(env, roles, ranks, block_addresses(["127.0.0.1"], [size], port + 1))
    addr = (env.get("MASTER_ADDR") or "").strip()
    if not addr:
        span = "on several nodes" if local_size else f"of {size} ranks, not known to be on one node"
        raise SchedulerError(
            f"{rank_var}={ranks.rank}: {job} {span} needs MASTER_ADDR, the host of rank 0, where the ranks gather "
            f"their addresses (one rank's environment does not say where the others run); start it with {start_with}"
        )
    own = None if local is None else port + 1 + local
    return resolver.from_ranks(env, roles, ranks, None, own, f"{addr}:{port}")
