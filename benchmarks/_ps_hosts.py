"""benchmarks/ps_step.py's contenders on three network-namespace hosts (root): 1 ps + 2 workers, one
launcher per host, and the bytes that crossed the ps host's (virtual) wire."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def on_hosts(script_path: str, args, out_dir: str, env: dict, contender: str) -> dict:
    """1 ps + 2 workers on three network-namespace hosts (tests/multihost/netns.py), one launcher each;
    ps_hosts with the wire's default across hosts (encrypted), ps_hosts_auth authenticated only,
    ps_hosts_before on the tree of --before-src (its remote calls across hosts: torch.distributed.rpc, whose
    tensors go by CMA between processes of one kernel, namespaces or not), ps_hosts_before_tcp the same with
    TensorPipe's tensors over its TCP connection, as between two machines (_tensorpipe_over_tcp/)."""
    sys.path.insert(0, os.path.join(REPO, "tests", "multihost"))
    from netns import Hosts

    with tempfile.TemporaryDirectory() as work:
        hosts = Hosts(3, pathlib.Path(work))
        try:
            cluster = {"ps": [f"{hosts[0].name}:7100"], "worker": [f"{hosts[1].name}:7101", f"{hosts[2].name}:7102"]}
            cluster_file = os.path.join(work, "cluster.json")
            with open(cluster_file, "w") as f:
                json.dump(cluster, f)
            script = [script_path, "--in-cluster", "--contender", contender, "--steps", str(args.steps),
                      "--warmup", str(args.warmup), "--out", out_dir]
            extra = {"PS_STEP_MODEL": args.model, "TOWERFLOW_CLUSTER_TOKEN": "ps-step-bench"}
            if contender == "ps_hosts_auth":
                extra["TOWERFLOW_WIRE_SECURITY"] = "authenticate"
            if contender == "ps_hosts_before":
                extra["PYTHONPATH"] = env["PYTHONPATH"]
            if contender == "ps_hosts_before_tcp":  # no CMA between the namespaces: tensors over TCP
                extra["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "_tensorpipe_over_tcp"), env["PYTHONPATH"]])
            wire_before = _wire_bytes(hosts[0])
            procs = [hosts.launch(hosts[0], cluster_file, "ps", 0, script, env=extra)]
            procs += [hosts.launch(hosts[1 + w], cluster_file, "worker", w, script, env=extra) for w in range(2)]
            for p in procs:
                if p.wait(600) != 0:
                    raise SystemExit(f"ps_hosts failed on {p.host.name}:\n{p.output[-3000:]}")
            wire_bytes = _wire_bytes(hosts[0]) - wire_before
        finally:
            hosts.close()
    workers = [json.load(open(os.path.join(out_dir, f"{contender}-{w}.json"))) for w in range(2)]
    return {"workers": workers, "ps_host_wire_bytes": wire_bytes}


def _wire_bytes(host) -> int:
    """Bytes in and out of `host`'s network interface so far: what crossed the (virtual) wire."""
    stats = "/sys/class/net/eth0/statistics/"
    out = subprocess.run(["ip", "netns", "exec", host.netns, "cat", stats + "rx_bytes", stats + "tx_bytes"],
                         capture_output=True, text=True, check=True).stdout.split()
    return sum(int(v) for v in out)
