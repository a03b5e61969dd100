"""Addresses gathered at runtime across two hosts (cluster/membership/gather.py): torchrun on two namespace hosts
gives each process only its rank; `towerflow launch --ps 1` under it gathers where every rank runs and
trains (docs/cluster.md, "torchrun")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "schedulers"))
from _slots import SLOT_TASK, free_port, slots  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def test_torchrun_on_two_hosts_gathers_the_cluster_and_trains(hosts):
    h = hosts(2)
    port = free_port()
    runs = [h.start(host, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                           "--nproc-per-node", "1", "--master-addr", h[0].name, "--master-port", str(port),
                           "-m", "towerflow", "launch", "--ps", "1", SLOT_TASK, "3"], f"node{i}")
            for i, host in enumerate(h.hosts)]
    assert [r.wait(120) for r in runs] == [0, 0], "\n".join(r.output[-3000:] for r in runs)
    found = slots(runs[1].output)
    assert [(s["job"], s["index"]) for s in found] == [("worker", 0)], runs[1].output[-3000:]
    cluster = found[0]["cluster"]
    # each rank's own host, as gathered: the ps on host 0, the worker on host 1
    assert cluster["ps"][0].startswith(h[0].address) and cluster["worker"][0].startswith(h[1].address), cluster
    assert found[0]["strategy"] == "parameter_server" and found[0]["global_step"] == 3
