"""Real schedulers for the tests: one Slurm for the session (slurm.py), Open MPI, and two Slurm nodes on
network-namespace hosts (tests/multihost/netns.py).

Nothing fails because a scheduler is missing, and nothing here installs one: tools/install_schedulers.sh
does (Slurm, munge, Open MPI), run by `make test` before pytest; where they are missing the tests skip,
naming it.
The startup times are printed in the terminal summary ("schedulers: ...").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent / "multihost")]

import slurm as slurm_mod  # noqa: E402
from _slots import kill_tree  # noqa: E402

TIMINGS: Dict[str, float] = {}


@pytest.fixture(scope="session")
def schedulers():
    why = slurm_mod.why_missing()
    if why:
        pytest.skip(f"real schedulers: {why}")


def _check_left(where: str, left: List[str]) -> None:
    if left:
        pytest.fail(f"{where} left processes behind: {left}")


@pytest.fixture(scope="session")
def slurm(schedulers, tmp_path_factory):
    """A one-node Slurm (this machine, its real CPU count, OverSubscribe=FORCE) for the whole session."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm fixture runs slurmctld and slurmd as root (SlurmUser=root)")
    t0 = time.monotonic()
    try:
        s = slurm_mod.Slurm(tmp_path_factory.mktemp("slurm"))
    except RuntimeError as e:
        pytest.fail(f"Slurm did not start: {e}")
    TIMINGS["one-node Slurm: start until idle"] = time.monotonic() - t0
    yield s
    t0 = time.monotonic()
    left = s.close()
    TIMINGS["one-node Slurm: stop"] = time.monotonic() - t0
    _check_left("the one-node Slurm", left)


class MPIRun:
    """`mpirun --allow-run-as-root --oversubscribe -n N argv` with a hard time limit."""

    def __init__(self, workdir: Path):
        self.workdir = workdir

    def argv(self, n: int, argv: Sequence[str]) -> List[str]:
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(n), *argv]

    def run(self, n: int, argv: Sequence[str], timeout: float = 60,
            extra: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        """The ranks inherit mpirun's environment (this one's without any job's variables, plus `extra`);
        at the deadline the whole session (mpirun and every rank) is killed."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_"))}
        env.update(extra or {})
        proc = subprocess.Popen(self.argv(n, argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, cwd=str(self.workdir), start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, err = proc.communicate()
            raise AssertionError(f"mpirun -n {n} {argv} still running after {timeout} s: {out}{err}") from None
        finally:
            kill_tree(proc.pid)  # whatever a rank left behind (a launcher's task in its own session)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        assert done.returncode == 0, f"mpirun -n {n} {argv} exited {done.returncode}: {done.stdout}{done.stderr}"
        return done


@pytest.fixture(scope="session")
def mpirun(schedulers, tmp_path_factory):
    if shutil.which("mpirun") is None:
        pytest.skip(f"Open MPI's mpirun is not installed (as root with apt-get: bash {slurm_mod.INSTALL})")
    return MPIRun(tmp_path_factory.mktemp("mpirun"))


@pytest.fixture(scope="session")
def slurm_two_hosts(schedulers, tmp_path_factory):
    """Two Slurm nodes, each a network-namespace host with its own slurmd; slurmctld on the first."""
    import netns

    why = netns.unavailable()
    if why:
        pytest.skip(f"multi-node Slurm needs network-namespace hosts: {why}")
    if shutil.which("nsenter") is None:
        pytest.skip("multi-node Slurm needs nsenter (util-linux)")
    work = tmp_path_factory.mktemp("slurm2")
    t0 = time.monotonic()
    hosts = netns.Hosts(2, work)
    try:
        by = {h.name: h for h in hosts.hosts}
        try:
            s = slurm_mod.Slurm(work / "slurm", [slurm_mod.Node(h.name, h.address) for h in hosts.hosts],
                                wrap=lambda n, argv: slurm_mod.on_netns_host(by[n.name], argv))
        except RuntimeError as e:
            pytest.fail(f"two-node Slurm did not start: {e}")
        TIMINGS["two-node Slurm (namespace hosts): start until idle"] = time.monotonic() - t0
        try:
            yield s
        finally:
            t0 = time.monotonic()
            left = s.close()
            TIMINGS["two-node Slurm: stop"] = time.monotonic() - t0
    finally:
        hosts.close()
    _check_left("the two-node Slurm", left)


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_line("schedulers: " + ", ".join(f"{k} {v:.1f} s" for k, v in TIMINGS.items()))
