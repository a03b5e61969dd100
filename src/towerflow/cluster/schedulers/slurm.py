"""Slurm: `srun` (or an `sbatch` script) tasks, from SLURM_* variables.

Ranks are SLURM_PROCID; hosts come from the step's hostlist (SLURM_STEP_NODELIST, else the
job's SLURM_JOB_NODELIST) and tasks per node (SLURM_STEP_TASKS_PER_NODE, else
SLURM_TASKS_PER_NODE). Slurm's block distribution is assumed: the first node runs ranks
0..n0-1, the next the following ones, and so on; anything else is refused.

Ports: tasks of two jobs (or two steps of one job) may share a node, so each job step gets its
own block of 64 ports, `20000 + 64 * ((SLURM_JOB_ID + 101 * SLURM_STEP_ID) % 625)`, and a task
listens at that base + its local index (SLURM_LOCALID). Every port is in 20000-59999; jobs
collide only when their ids are congruent modulo 625.
"""

from __future__ import annotations

from typing import Mapping

from towerflow.cluster.schedulers.base import Ranks, Resolved, Roles, SchedulerResolver, block_addresses, count, text
from towerflow.cluster.schedulers.hostlist import expand_hostlist, expand_tasks_per_node
from towerflow.errors import SchedulerError

PORT_FIRST, PORT_BLOCK, PORT_BLOCKS = 20000, 64, 625  # 20000 + 64 * 625 = 60000
_FIX = "run the tasks with srun inside the allocation (sbatch/salloc), or set TOWERFLOW_SCHEDULER to another scheduler"
_BLOCK = "run srun with --distribution=block (towerflow places rank r on the node Slurm's block distribution gives it)"


def port_base(job_id: int, step_id: int) -> int:
    """The first port of a job step's block: 20000 + 64 * ((job id + 101 * step id) % 625)."""
    return PORT_FIRST + PORT_BLOCK * ((job_id + 101 * step_id) % PORT_BLOCKS)


class SlurmResolver(SchedulerResolver):
    name = "slurm"
    reads = ("SLURM_", "SLURMD_NODENAME")

    def detect(self, env: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in env and ("SLURM_JOB_ID" in env or "SLURM_JOBID" in env)

    def resolve(self, env: Mapping[str, str], roles: Roles) -> Resolved:
        step = "SLURM_STEP_NODELIST" in env
        nodelist_var = "SLURM_STEP_NODELIST" if step else next(
            (v for v in ("SLURM_JOB_NODELIST", "SLURM_NODELIST") if v in env), "SLURM_JOB_NODELIST")
        tpn_var = "SLURM_STEP_TASKS_PER_NODE" if step else "SLURM_TASKS_PER_NODE"
        ntasks_var = "SLURM_STEP_NUM_TASKS" if step else ("SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS")
        job_var = "SLURM_JOB_ID" if "SLURM_JOB_ID" in env else "SLURM_JOBID"
        self._check_distribution(env)
        rank = count(env, "SLURM_PROCID", "this task's rank", required=True, fix=_FIX)
        ntasks = count(env, ntasks_var, "the number of tasks", required=True, minimum=1, fix=_FIX)
        job_id = count(env, job_var, "the job id (towerflow derives the ports from it)", required=True, fix=_FIX)
        hosts = expand_hostlist(text(env, nodelist_var, "the nodes of the job", _FIX))
        counts = expand_tasks_per_node(text(env, tpn_var, "how many tasks each node runs", _FIX))
        where = f"{nodelist_var}={env[nodelist_var]!r} with {tpn_var}={env[tpn_var]!r}"
        if len(counts) != len(hosts):
            raise SchedulerError(f"{where}: {len(hosts)} nodes but {len(counts)} task counts; expected one count per node")
        if sum(counts) != ntasks:
            raise SchedulerError(f"{where} places {sum(counts)} tasks, but {ntasks_var}={ntasks}")
        if rank >= ntasks:
            raise SchedulerError(f"SLURM_PROCID={rank} with {ntasks_var}={ntasks}: expected a rank below the task count")
        node, local = self._block_place(rank, counts)
        self._check_place(env, rank, hosts, node, local, where)
        if max(counts) > PORT_BLOCK:
            raise SchedulerError(f"{where} runs {max(counts)} tasks on one node; towerflow gives each job step "
                                 f"{PORT_BLOCK} ports per node: run at most {PORT_BLOCK} tasks per node")
        step_id = env.get("SLURM_STEP_ID", "0")
        base = port_base(job_id, int(step_id) if step_id.isdigit() else 0)
        return self.from_ranks(env, roles, Ranks(rank, ntasks, local, counts[node]), block_addresses(hosts, counts, base))

    @staticmethod
    def _block_place(rank: int, counts) -> tuple:
        start = 0
        for node, n in enumerate(counts):
            if rank < start + n:
                return node, rank - start
            start += n
        raise AssertionError("rank below the task count")

    @staticmethod
    def _check_distribution(env: Mapping[str, str]) -> None:
        raw = env.get("SLURM_DISTRIBUTION", "")
        across_nodes = raw.split(":")[0].strip().lower()
        if across_nodes not in ("", "block", "*"):
            raise SchedulerError(f"SLURM_DISTRIBUTION={raw!r}: the tasks are not in block order across the nodes; "
                                 f"{_BLOCK}")

    @staticmethod
    def _check_place(env, rank, hosts, node, local, where) -> None:
        said = {"SLURM_LOCALID": env.get("SLURM_LOCALID"), "SLURM_NODEID": env.get("SLURM_NODEID"),
                "SLURMD_NODENAME": env.get("SLURMD_NODENAME")}
        expected = {"SLURM_LOCALID": str(local), "SLURM_NODEID": str(node), "SLURMD_NODENAME": hosts[node]}
        wrong = [f"{k}={v!r}" for k, v in said.items() if v not in (None, "") and v.strip() != expected[k]]
        if wrong:
            raise SchedulerError(
                f"SLURM_PROCID={rank} runs with {', '.join(wrong)}, but block distribution over {where} puts it on "
                f"node {node} ({hosts[node]!r}) as local task {local}: the tasks are not in block order; {_BLOCK}"
            )
