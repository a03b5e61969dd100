"""The ps side of parameter-server training: what a ps task runs (`python -m towerflow.ps.serve`).

`endpoints.py` receives the workers' calls (named in `ps/messages.py`) and keeps this process's
`ShardService`s (`service.py`: the shards, their optimizer, the table shards); each service's
`coordinator.py` keeps the global step, clocks and held gradients, and its policy
(`policies.py`: async, sync, ssp, built from the worker's `PolicySpec`) decides. A service hands its
mutating calls and its replies to a replica log (`replies.py`); `replication/` backs the part up on
another ps task (`--ps-replicas 2`). `linked.py` serves the steps of a same-host link, `monitor.py`
records the ps's counters. This side imports nothing of `ps/worker/`.
"""
