"""Open MPI's mpirun across two hosts (network namespaces): its ranks on another host are started through
a remote shell that enters that host, as ssh would; each rank knows only its rank, so `towerflow launch`
gathers where every rank runs at MASTER_ADDR and trains (docs/cluster.md, "MPI")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from _slots import SLOT_TASK, free_port, slots

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

# mpirun's remote shell, called as `agent HOST COMMAND...` like ssh: COMMAND runs in HOST's namespace,
# with its hostname, through a shell (Open MPI passes variable settings and `orted` as shell words)
AGENT = """#!/bin/sh
host="$1"; shift
exec ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
"""


@pytest.fixture
def two_hosts(mpirun, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multihost"))
    import netns

    why = netns.unavailable()
    if why:
        pytest.skip(f"mpirun across hosts needs network-namespace hosts: {why}")
    hosts = netns.Hosts(2, tmp_path)
    yield hosts
    hosts.close()


def test_mpirun_ranks_on_two_hosts_gather_the_cluster_and_train(two_hosts, tmp_path):
    h = two_hosts
    agent = tmp_path / "netns_rsh"
    agent.write_text(AGENT)
    agent.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{host.name} slots=1\n" for host in h.hosts))
    argv = ["mpirun", "--allow-run-as-root", "-n", "2", "--hostfile", str(hostfile), "--mca", "plm_rsh_agent", str(agent),
            "--mca", "oob_tcp_if_include", "eth0", *[a for name in ("PATH", "PYTHONPATH", "OMP_NUM_THREADS", "MASTER_ADDR",
                                                                    "MASTER_PORT", "TOWERFLOW_CLUSTER_TOKEN")
                                                     for a in ("-x", name)],
            sys.executable, "-m", "towerflow", "launch", "--ps", "1", SLOT_TASK, "3"]
    run = h.start(h[0], argv, "mpirun", {"MASTER_ADDR": h[0].name, "MASTER_PORT": str(free_port()),
                                         "TOWERFLOW_CLUSTER_TOKEN": "mpi-two-hosts"})
    assert run.wait(150) == 0, run.output[-4000:]
    found = slots(run.output)
    assert [(s["host"], s["job"], s["index"]) for s in found] == [(h[1].name, "worker", 0)], run.output[-4000:]
    cluster = found[0]["cluster"]
    # rank 0 is the ps on the first host, rank 1 the worker on the second, at the addresses they gathered
    assert cluster["ps"][0].startswith(h[0].address + ":") and cluster["worker"][0].startswith(h[1].address + ":"), cluster
    assert found[0]["global_step"] == 3 and found[0]["strategy"] == "parameter_server"
