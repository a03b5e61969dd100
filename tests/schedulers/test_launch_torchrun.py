"""torchrun's own processes with strategy_from_env() (docs/cluster.md, "torchrun"): a replica group of
torchrun's, kept as it is (MirroredStrategy on one node)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from torch.distributed.run import get_args_parser

from _slots import SLOT_TASK, cluster_jsons, free_master_port, kill_tree, slots, still_running, task_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _torchrun(tmp_path, *args: str) -> str:
    """`torchrun --nproc-per-node 2 ARGS` with a hard deadline; its output (every process killed on the way out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")}
    env.update(task_env())
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_master_port(2)),
            *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        running = still_running(proc.pid)
        kill_tree(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun still running after 120 s:\n{running}\n{out[-4000:]}") from None
    finally:
        kill_tree(proc.pid)
    print(f"torchrun --nproc-per-node 2 {' '.join(args)}: {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, out[-4000:]
    return out


def test_torchrun_two_processes_train_together(tmp_path):
    out = _torchrun(tmp_path, SLOT_TASK, "3")
    found = slots(out)
    assert [s["rank"] for s in found] == [0, 1] and {s["world_size"] for s in found} == {2}, out[-4000:]
    assert {s["strategy"] for s in found} == {"mirrored"}


def test_cluster_json_under_torchrun(tmp_path):
    ranks = cluster_jsons(_torchrun(tmp_path, "-m", "towerflow", "cluster", "--json"))
    assert sorted(r["task"]["index"] for r in ranks) == [0, 1] and {r["scheduler"] for r in ranks} == {"torchrun"}
    assert {r["task"]["type"] for r in ranks} == {"worker"} and len({str(r["cluster"]) for r in ranks}) == 1


@pytest.mark.skipif(not any("--virtual-local-rank" in a.option_strings for a in get_args_parser()._actions),
                    reason="this torchrun has no --virtual-local-rank")
def test_cluster_json_under_virtual_local_rank_binds_each_rank_to_its_own_entry(tmp_path):
    """Every worker has LOCAL_RANK=0 there: each rank's port is still its own cluster entry's, so they differ."""
    ranks = cluster_jsons(_torchrun(tmp_path, "--virtual-local-rank", "-m", "towerflow", "cluster", "--json"))
    assert [r["local_rank"] for r in ranks] == [0, 0] and [r["device"] for r in ranks] == ["gpu:0", "gpu:0"]
    assert [r["port"] for r in ranks] == [int(r["address"].rsplit(":", 1)[1]) for r in ranks]
    assert ranks[0]["port"] != ranks[1]["port"]
