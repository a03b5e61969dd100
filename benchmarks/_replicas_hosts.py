"""benchmarks/ps_replicas.py's jobs on three network-namespace hosts (root), as on three machines
(tests/multihost/netns.py): ps 0 alone, ps 1 beside worker 0, worker 1 on the third, a launcher per task, so that
with `--ps-replicas 2` each part's mirror is on another host and every forwarded push crosses the (virtual) wire."""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile
from typing import Dict, List

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "multihost"))
from netns import Hosts  # noqa: E402

PLACES = ((("ps", 0),), (("ps", 1), ("worker", 0)), (("worker", 1),))


def outputs(procs, timeout: float, what: str) -> str:
    """The processes' output once every one exited 0 within `timeout` s; RuntimeError naming the first that did not."""
    for proc in procs:
        if proc.wait(timeout) != 0:
            raise RuntimeError(f"{what} on {proc.host.name} exited {proc.popen.returncode}:\n{proc.output[-4000:]}")
    return "\n".join(proc.output for proc in procs)


def run_on_hosts(script_argv: List[str], launch_flags: List[str], env: Dict[str, str], timeout: float) -> str:
    """Every task's launcher output, once all ended with 0 (RuntimeError naming the host otherwise)."""
    with tempfile.TemporaryDirectory() as work:
        hosts = Hosts(3, pathlib.Path(work))
        try:
            port = iter(range(7100, 7200))
            cluster: Dict[str, List[str]] = {"ps": [], "worker": []}
            for host, tasks in zip(hosts.hosts, PLACES):
                for job, _ in tasks:
                    cluster[job].append(f"{host.name}:{next(port)}")
            cluster_file = pathlib.Path(work) / "cluster.json"
            cluster_file.write_text(json.dumps(cluster))
            extra = {**env, "TOWERFLOW_CLUSTER_TOKEN": "ps-replicas-bench"}
            procs = [hosts.launch(host, cluster_file, job, index, script_argv, env=extra, launch_flags=launch_flags)
                     for host, tasks in zip(hosts.hosts, PLACES) for job, index in tasks]
            return outputs(procs, timeout, "a task")
        finally:
            hosts.close()
