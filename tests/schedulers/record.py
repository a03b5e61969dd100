"""Record what each task of a real scheduler job sees: the golden files of tests/schedulers/recorded/.

    sudo PYTHONPATH=src python tests/schedulers/record.py [OUTDIR]     (default: tests/schedulers/recorded)

Starts the one-node Slurm of slurm.py, then two Slurm nodes on network-namespace hosts, and Open MPI; runs
each command of `RECORDINGS` with `env` as the task, and writes one JSON file per command: the scheduler
and its version, the command, and per task (in rank order) the SLURM_*, SLURMD_*, PMI_*, PMIX_* and OMPI_*
variables it saw. Paths, ports, pids and keys of this machine are left out; `dropped` names them.
The tests import the same functions to compare a live job with the recorded one (test_recorded.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "multihost")]

import slurm as slurm_mod  # noqa: E402

RECORDED = HERE / "recorded"
PREFIXES = ("SLURM_", "SLURMD_", "PMI_", "PMIX_", "OMPI_")
# machine-specific noise (paths, ports, pids, umask, temporary directories) and anything secret
NOISE = re.compile(
    r"^(SLURM_CONF|SLURM_TASK_PID|SLURM_WORKING_CLUSTER|SLURM_SUBMIT_DIR|SLURM_UMASK|SLURM_PRIO_PROCESS"
    r"|SLURM_SRUN_COMM_PORT|SLURM_STEP_LAUNCHER_PORT|PMI_FD|OMPI_FILE_LOCATION|OMPI_ARGV|OMPI_MCA_initial_wdir"
    r"|OMPI_MCA_orte_\w*session_dir|OMPI_MCA_orte_tmpdir_base|OMPI_MCA_orte_output_filename|OMPI_MCA_shmem_\w+|PMIX_DSTORE_\w+"
    r"|PMIX_SERVER_TMPDIR|PMIX_SYSTEM_TMPDIR|PMIX_SERVER_URI\w*|PMIX_MCA_\w+|PMIX_BFROP_\w+|PMIX_GDS_MODULE"
    r"|PMIX_SECURITY_MODE)$"
    r"|KEY|SECRET|TOKEN|CRED|PASS|precondition_transports", re.IGNORECASE)


def parse_env(text: str) -> Dict[str, str]:
    """`env` output -> the scheduler's variables (one line each; other lines are ignored)."""
    out = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.startswith(PREFIXES) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            out[name] = value
    return out


def clean(env: Dict[str, str]) -> Tuple[Dict[str, str], List[str]]:
    """(what a resolver reads, the names left out as noise or secrets)."""
    kept = {k: v for k, v in sorted(env.items()) if not NOISE.search(k)}
    return kept, sorted(set(env) - set(kept))


def slurm_task_envs(s: "slurm_mod.Slurm", argv: Sequence[str], outdir: Path, node=None,
                    timeout: float = 60) -> List[Dict[str, str]]:
    """Run `argv` (a Slurm command line whose tasks run `env`, with `{out}` where the per-task output
    pattern goes) and read each task's environment, in task order."""
    outdir.mkdir(parents=True, exist_ok=True)
    for f in outdir.glob("*.env"):
        f.unlink()
    s.run([a.replace("{out}", str(outdir / "%t.env")) for a in argv], timeout=timeout, node=node)
    files = sorted(outdir.glob("*.env"), key=lambda f: int(f.stem))
    return [parse_env(f.read_text()) for f in files]


def mpirun_argv(n: int, outdir: Path) -> List[str]:
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(n), "--output-filename", str(outdir)]


def mpirun_task_envs(n: int, outdir: Path, timeout: float = 60) -> List[Dict[str, str]]:
    """`mpirun --allow-run-as-root --oversubscribe -n N env`: each rank's environment, in rank order."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIXES)}
    try:
        subprocess.run([*mpirun_argv(n, outdir), "env"], env=env, capture_output=True, text=True, timeout=timeout,
                       check=True, stdin=subprocess.DEVNULL)
    except subprocess.CalledProcessError as e:
        raise AssertionError(f"mpirun exited {e.returncode}: {e.stdout}{e.stderr}") from None
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"mpirun still running after {timeout} s: {e.stdout}{e.stderr}") from None
    files = sorted(outdir.glob("*/rank.*/stdout"), key=lambda f: int(f.parent.name.split(".")[1]))
    return [parse_env(f.read_text()) for f in files]


def version(argv: Sequence[str]) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    return (out.stdout or out.stderr).splitlines()[0].strip()


def shown(argv: Sequence[str]) -> str:
    """A recorded command line as a reader would type it: OUT for the per-task output, BATCH for sbatch's."""
    return " ".join(argv).replace("{out}.batch", "BATCH").replace("{out}", "OUT/%t.env")


def document(scheduler: str, command: str, tasks: List[Dict[str, str]], note: str = "") -> Dict:
    kept, dropped = [], set()
    for t in tasks:
        k, d = clean(t)
        kept.append(k)
        dropped.update(d)
    doc = {"scheduler": scheduler, "command": command, "ntasks": len(tasks)}
    if note:
        doc["note"] = note
    doc.update({"tasks": kept, "dropped": sorted(dropped)})
    return doc


# name -> (Slurm command line run with `srun`'s per-task output in {out}, note)
SLURM_ONE_NODE = {
    "slurm_srun_overcommit_n3": (["srun", "--overcommit", "-n", "3", "-o", "{out}", "env"], ""),
    "slurm_srun_ntasks_per_node": (
        ["srun", "-n", "{cpus}", "--ntasks-per-node={cpus}", "-o", "{out}", "env"],
        "srun -n 3 --ntasks-per-node=3 is refused on a node with fewer than 3 CPUs, --overcommit or not "
        "('Requested node configuration is not available'): recorded with as many tasks as the node has CPUs"),
    "slurm_srun_pmi2_n3": (["srun", "--mpi=pmi2", "--overcommit", "-n", "3", "-o", "{out}", "env"],
                           "--mpi=pmi2 adds PMI_RANK, PMI_SIZE, PMI_JOBID (PMI_FD dropped)"),
    "slurm_salloc_srun_n3": (["salloc", "-n", "3", "--overcommit", "srun", "-o", "{out}", "env"],
                             "salloc without a terminal runs its command in the allocation; srun takes all 3 tasks"),
    "slurm_sbatch_srun_n3": (["sbatch", "--wait", "-n", "3", "--overcommit", "-o", "{out}.batch",
                              "--wrap", "env > {out}.batch.env; srun -o {out} env"],
                             "the tasks of an srun inside an sbatch script"),
}


def record_one_node(s: "slurm_mod.Slurm", work: Path) -> Dict[str, Dict]:
    scheduler = version(["slurmd", "-V"]).replace("slurm-wlm", "slurm")
    docs = {}
    for name, (argv, note) in SLURM_ONE_NODE.items():
        argv = [a.replace("{cpus}", str(s.cpus)) for a in argv]
        if name == "slurm_sbatch_srun_n3":
            out = work / name
            tasks = slurm_task_envs(s, [a.replace("{out}.batch", str(work / "batch")) for a in argv], out)
            batch = parse_env((work / "batch.env").read_text())
            docs["slurm_sbatch_batch_step"] = document(
                scheduler, shown(argv),
                [batch], "the batch script's own environment (no srun): the batch step, one process")
        else:
            tasks = slurm_task_envs(s, argv, work / name)
        docs[name] = document(scheduler, shown(argv), tasks, note)
    return docs


def record_mpirun(work: Path) -> Dict[str, Dict]:
    tasks = mpirun_task_envs(3, work / "mpirun")
    return {"openmpi_mpirun_n3": document(
        version(["mpirun", "--version"]), "mpirun --allow-run-as-root --oversubscribe -n 3 --output-filename OUT env",
        tasks)}


MULTINODE = ["srun", "-N", "2", "-n", "4", "-o", "{out}", "env"]


def record_multinode(s: "slurm_mod.Slurm", work: Path) -> Dict[str, Dict]:
    tasks = slurm_task_envs(s, MULTINODE, work / "multinode")
    return {"slurm_multinode_srun_N2_n4": document(
        version(["slurmd", "-V"]).replace("slurm-wlm", "slurm"), shown(MULTINODE),
        tasks, "two Slurm nodes, each a network-namespace host of tests/multihost/netns.py with its own slurmd "
               "(slurmd -N NAME, NodeAddr=its address); srun ran on the first, where slurmctld runs")}


def write(docs: Dict[str, Dict], outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    for name, doc in docs.items():
        (outdir / f"{name}.json").write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        print(f"wrote {outdir / name}.json ({doc['ntasks']} tasks)")


def main(outdir: Optional[Path] = None) -> None:
    outdir = outdir or RECORDED
    why = slurm_mod.why_missing()
    if why:
        sys.exit(why)
    import netns

    with tempfile.TemporaryDirectory(prefix="tf-record-") as tmp:
        work = Path(tmp)
        docs = record_mpirun(work)
        s = slurm_mod.Slurm(work / "one-node")
        try:
            docs.update(record_one_node(s, work))
        finally:
            s.close()
        hosts = netns.Hosts(2, work)
        try:
            by = {h.name: h for h in hosts.hosts}
            s = slurm_mod.Slurm(work / "two-nodes", [slurm_mod.Node(h.name, h.address) for h in hosts.hosts],
                                wrap=lambda n, argv: slurm_mod.on_netns_host(by[n.name], argv))
            try:
                docs.update(record_multinode(s, work))
            finally:
                s.close()
        finally:
            hosts.close()
    write(docs, outdir)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
