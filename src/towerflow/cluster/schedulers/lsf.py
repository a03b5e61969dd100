"""IBM Spectrum LSF's `jsrun` (JSM_NAMESPACE_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE), as on Summit.

Like `mpirun`, one rank's environment does not say where the others run: ranks of one node
(JSM_NAMESPACE_LOCAL_SIZE == JSM_NAMESPACE_SIZE) are placed on 127.0.0.1, rank r at MASTER_PORT + 1 + r;
across nodes they gather their addresses at MASTER_ADDR:MASTER_PORT (`jsrun -E MASTER_ADDR=<rank 0's host>`).
"""

from __future__ import annotations

from typing import Mapping

from towerflow.cluster.schedulers.base import Ranks, Resolved, Roles, SchedulerResolver, count
from towerflow.cluster.schedulers.mpi import place_without_hosts

_FIX = "jsrun sets it for every rank; start the script with jsrun"


class LSFResolver(SchedulerResolver):
    name = "lsf"
    reads = ("JSM_NAMESPACE_", "MASTER_ADDR", "MASTER_PORT")

    def detect(self, env: Mapping[str, str]) -> bool:
        return "JSM_NAMESPACE_RANK" in env

    def resolve(self, env: Mapping[str, str], roles: Roles) -> Resolved:
        size = count(env, "JSM_NAMESPACE_SIZE", "the number of ranks", required=True, minimum=1, fix=_FIX)
        ranks = Ranks(count(env, "JSM_NAMESPACE_RANK", "this process's rank", required=True, fix=_FIX), size,
                      count(env, "JSM_NAMESPACE_LOCAL_RANK", "this rank's index on its node"),
                      count(env, "JSM_NAMESPACE_LOCAL_SIZE", "the number of ranks on this node", minimum=1))
        return place_without_hosts(self, env, roles, ranks, "JSM_NAMESPACE_RANK", "an LSF job",
                                   "`jsrun -E MASTER_ADDR=<rank 0's host> [-E MASTER_PORT=<port>] ...`")
