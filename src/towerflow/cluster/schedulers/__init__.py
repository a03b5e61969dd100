"""Scheduler resolvers: which task this process is, from what Slurm, MPI, Kubernetes or torchrun set.

Detection order (the first whose `detect` holds wins; `TOWERFLOW_SCHEDULER=NAME` picks one):

1. `tf_config`: TOWERFLOW_JOB_NAME, or a TF_CONFIG with a cluster that is not a Kubeflow TFJob's;
   what `towerflow launch` writes, or the user, names this very process, so it wins over any
   scheduler the launcher itself ran under.
2. `skypilot`: SKYPILOT_NODE_RANK with SKYPILOT_NODE_IPS, outside torchrun: a SkyPilot task's run command on
   each node (on whatever SkyPilot runs it, Kubernetes and Slurm included).
3. `kubernetes`: KUBERNETES_SERVICE_HOST with a TFJob's TF_CONFIG or a PyTorchJob's MASTER_ADDR / PET_*.
4. `torchrun`: TORCHELASTIC_RUN_ID or GROUP_RANK: a child of torchrun, even under srun, mpirun or SkyPilot.
5. `mpi`: OMPI_COMM_WORLD_RANK (mpirun inside an sbatch allocation sees SLURM_* too, but its ranks
   are MPI's), or PMI_RANK / PMIX_RANK without SLURM_PROCID.
6. `lsf`: JSM_NAMESPACE_RANK, IBM Spectrum LSF's jsrun.
7. `slurm`: SLURM_PROCID with SLURM_JOB_ID.
8. `env`: torch.distributed's env:// variables alone (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as
   Ray Train or Azure ML set them; a world of one without MASTER_ADDR/MASTER_PORT is a plain process.

Nothing detected: not distributed (`resolve` returns None). `towerflow cluster`, `strategy_from_env()`,
`read_task` and `towerflow launch` all ask this one registry, so they agree on what a process is.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

from towerflow import taskenv as _te
from towerflow.cluster.schedulers.base import Ranks, Resolved, Roles, SchedulerResolver
from towerflow.cluster.schedulers.env import EnvResolver
from towerflow.cluster.schedulers.kubernetes import KubernetesResolver
from towerflow.cluster.schedulers.lsf import LSFResolver
from towerflow.cluster.schedulers.mpi import MPIResolver
from towerflow.cluster.schedulers.skypilot import SkyPilotResolver
from towerflow.cluster.schedulers.slurm import SlurmResolver
from towerflow.cluster.schedulers.tf_config import TFConfigResolver
from towerflow.cluster.schedulers.torchrun import TorchrunResolver
from towerflow.errors import ClusterSpecError, SchedulerError, did_you_mean

# In detection order.
RESOLVERS: Dict[str, SchedulerResolver] = {
    r.name: r for r in (TFConfigResolver(), SkyPilotResolver(), KubernetesResolver(), TorchrunResolver(), MPIResolver(),
                        LSFResolver(), SlurmResolver(), EnvResolver())
}

__all__ = ["NO_SCHEDULER", "RESOLVERS", "Ranks", "Resolved", "Roles", "SchedulerResolver", "detect", "resolve",
           "resolve_scheduler", "resolver"]

NO_SCHEDULER = "none"  # --scheduler none / TOWERFLOW_SCHEDULER=none: ignore any scheduler


def resolver(name: str) -> SchedulerResolver:
    """The resolver called `name`; the error lists the names and suggests the closest."""
    if name not in RESOLVERS:
        raise SchedulerError(f"unknown scheduler {name!r} ({_te.ENV_SCHEDULER} or --scheduler); the schedulers are "
                             f"{', '.join(RESOLVERS)}.{did_you_mean(name, RESOLVERS)}")
    return RESOLVERS[name]


def detect(env: Mapping[str, str]) -> Optional[SchedulerResolver]:
    """The first resolver, in detection order, that recognises `env`; None when none does."""
    return next((r for r in RESOLVERS.values() if r.detect(env)), None)


def resolve(env: Mapping[str, str], scheduler: Optional[str] = None, roles: Optional[Roles] = None) -> Optional[Resolved]:
    """This task and its cluster from `env` (e.g. `taskenv.from_environment().scheduler_env`); None: not distributed.

    `scheduler` (else TOWERFLOW_SCHEDULER) names the resolver instead of detecting one; `roles`
    (else TOWERFLOW_PS_TASKS / TOWERFLOW_CHIEF / TOWERFLOW_EVALUATOR) split ranks into jobs.
    """
    name = scheduler or (env.get(_te.ENV_SCHEDULER) or "").strip() or None
    chosen = resolver(name) if name else detect(env)
    if chosen is None:
        return None
    try:
        return chosen.resolve(env, Roles.from_env(env) if roles is None else roles)
    except SchedulerError:
        raise
    except ClusterSpecError as e:  # a bad TF_CONFIG or cluster: named as this scheduler's
        raise SchedulerError(f"{chosen.name}: {e}") from None


def resolve_scheduler(env: Mapping[str, str], scheduler: Optional[str] = None,
                      roles: Optional[Roles] = None) -> Optional[Resolved]:
    """As `resolve`, for a process nothing has placed yet (`towerflow launch` under srun, a plain `srun python`):
    a detected TF_CONFIG / TOWERFLOW_JOB_NAME is not a scheduler here (it names a task already placed; the
    caller reads it itself), and `none` ignores any scheduler. None: no scheduler."""
    name = (scheduler or env.get(_te.ENV_SCHEDULER) or "").strip() or None
    if name == NO_SCHEDULER:
        return None
    if name is None:
        found = detect(env)
        if found is None or found.name == "tf_config":
            return None
        name = found.name
    return resolve(env, scheduler=name, roles=roles)
