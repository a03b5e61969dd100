"""SkyPilot: a task's `run` command on each node of a multi-node cluster (`num_nodes: N`).

SkyPilot runs the command once per node and sets SKYPILOT_NODE_RANK (this node, 0 for the head),
SKYPILOT_NUM_NODES, SKYPILOT_NODE_IPS (one address per line, the head first) and
SKYPILOT_NUM_GPUS_PER_NODE. The process the command starts is one task per node: rank = node rank,
at its node's address, port MASTER_PORT + 1 (29501 when MASTER_PORT is unset), using the node's
first GPU. To run one task per GPU, start `torchrun --nproc-per-node $SKYPILOT_NUM_GPUS_PER_NODE`
(whose children the torchrun resolver places) instead.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from towerflow.cluster.schedulers.base import Ranks, Resolved, Roles, SchedulerResolver, block_addresses, count, text
from towerflow.errors import SchedulerError

DEFAULT_PORT = 29500
_FIX = "SkyPilot sets it in a task's run command; start the script from the task YAML's `run:`"


class SkyPilotResolver(SchedulerResolver):
    name = "skypilot"
    reads = ("SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_GPUS_PER_NODE",
             "MASTER_PORT")

    def detect(self, env: Mapping[str, str]) -> bool:  # torchrun's children keep SkyPilot's variables: theirs win
        return ("SKYPILOT_NODE_RANK" in env and "SKYPILOT_NODE_IPS" in env
                and not ("TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env))

    def resolve(self, env: Mapping[str, str], roles: Roles) -> Resolved:
        ips = [line.strip() for line in text(env, "SKYPILOT_NODE_IPS", "the nodes' addresses", _FIX).splitlines()
               if line.strip()]
        rank = count(env, "SKYPILOT_NODE_RANK", "this node's rank", required=True, fix=_FIX)
        nodes = count(env, "SKYPILOT_NUM_NODES", "the number of nodes", minimum=1) or len(ips)
        if nodes != len(ips):
            raise SchedulerError(f"SKYPILOT_NUM_NODES={nodes} but SKYPILOT_NODE_IPS lists {len(ips)} addresses: "
                                 "expected one address per node")
        if rank >= nodes:
            raise SchedulerError(f"SKYPILOT_NODE_RANK={rank} with {nodes} nodes: expected a rank below the node count")
        gpus = count(env, "SKYPILOT_NUM_GPUS_PER_NODE", "the GPUs of each node") or 0
        port = (count(env, "MASTER_PORT", "the rendezvous port", minimum=1) or DEFAULT_PORT) + 1
        resolved = self.from_ranks(env, roles, Ranks(rank, nodes, 0, 1), block_addresses(ips, [1] * nodes, port))
        return resolved if gpus else dataclasses.replace(resolved, device=None)
