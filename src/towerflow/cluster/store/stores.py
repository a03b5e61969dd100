"""Where a cluster's rendezvous store lives, and the record that says whose cluster it holds.

Two kinds: a c10d TCPStore served on a held socket (by `towerflow launch` for a local cluster,
else by the coordinator task), or etcd (`TOWERFLOW_STORE=etcd://...`, `towerflow launch --store`),
which no task hosts, so the rendezvous outlives every task and host (cluster/store/etcd_store.py).
Either way the store holds one publisher record: the cluster spec's fingerprint, whether it has a
token and a proof of it, which every joining task checks (rendezvous.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
from typing import Optional, Tuple

from towerflow import etcd_url
from towerflow import taskenv as _taskenv
from towerflow.cluster.store import c10d as _c10d
from towerflow.cluster.spec import ClusterLike, ClusterSpec, split_address
from towerflow.errors import ClusterJoinError

PUBLISHER_KEY = "coordinator"


def proof(token: Optional[str], nonce: str, what: str) -> str:
    """Shows the store's publisher (or a slot's claimant) knows the token without sending it."""
    return hmac.new((token or "").encode(), f"{nonce}:{what}".encode(), hashlib.sha256).hexdigest()


def publisher_record(cluster: ClusterSpec, token: Optional[str], publisher: str) -> str:
    """The cluster as its store's publisher states it (JSON), with a fresh nonce and the token's proof."""
    nonce = secrets.token_hex(16)
    return json.dumps({"task": publisher, "pid": os.getpid(), "host": socket.gethostname(),
                       "cluster": cluster.as_dict(), "fingerprint": cluster.fingerprint(),
                       "has_token": token is not None, "nonce": nonce, "proof": proof(token, nonce, "coordinator")})


def serve_store(sock: socket.socket, cluster: ClusterSpec, token: Optional[str], host_name: str, timeout: float):
    """Serve the rendezvous store on a listening socket and publish the cluster in it; returns (store, nonce)."""
    store = _c10d.prefix_store("towerflow", _c10d.host_store(sock, timeout))
    record = publisher_record(cluster, token, host_name)
    store.set(PUBLISHER_KEY, record)
    return store, json.loads(record)["nonce"]


def host_rendezvous(cluster: ClusterLike, token: Optional[str], address: str, timeout: float = _taskenv.DEFAULT_JOIN_TIMEOUT):
    """Host a cluster's rendezvous store outside its tasks (what `towerflow launch` does for a local
    cluster), so that it outlives any task: a killed chief can then be restarted and rejoin.

    Tasks find it through TOWERFLOW_STORE=address. Returns the store; it serves while referenced.
    """
    cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
    host, port = split_address(address)
    try:
        sock = _c10d.listen(host, port)
    except OSError as e:
        raise ClusterJoinError(f"cannot host the rendezvous store at {address!r}: {e.strerror or e}") from None
    return serve_store(sock, cluster, token, f"towerflow launch (pid {os.getpid()})", timeout)[0]


def etcd_prefix(address: etcd_url.EtcdAddress, cluster: ClusterSpec) -> str:
    """The run's keys in etcd: under the URL's prefix, else one named after the cluster spec (so that
    clusters of other specs sharing an etcd never meet)."""
    return f"towerflow/{address.prefix or cluster.fingerprint()[:16]}"


def open_etcd(url: str, cluster: ClusterSpec, timeout: float, reach_within: float, who: str):
    """The rendezvous store of `cluster` in etcd at `url` (a TOWERFLOW_STORE value), and the `EtcdStore` under
    it (its records outlive the run). ClusterJoinError naming every member and why, when none answers within
    `reach_within` s (never a hang)."""
    address = etcd_url.parse_etcd_url(url, _taskenv.ENV_STORE)
    from towerflow.cluster.store.etcd_store import EtcdStore

    try:  # EtcdUnavailable (a ConnectionError) names each member's error
        store = EtcdStore(address.endpoints, etcd_prefix(address, cluster), timeout, reach_within=reach_within)
    except ConnectionError as e:
        raise ClusterJoinError(
            f"{who} cannot reach the cluster's store in etcd at {url!r} within {reach_within:.0f} s: {e}. Start etcd "
            f"there (every member listed must be an etcd client URL), correct {_taskenv.ENV_STORE} / "
            "--store, or raise the wait with " + _taskenv.ENV_JOIN_TIMEOUT + ".",
            task=who,
        ) from None
    return _c10d.prefix_store("towerflow", store), store


def read_publisher(store) -> Optional[dict]:
    """The publisher record of the run the store holds now, or None (no task has published one yet)."""
    return json.loads(store.get(PUBLISHER_KEY)) if store.check([PUBLISHER_KEY]) else None


def publish_or_read(store, cluster: ClusterSpec, token: Optional[str], who: str) -> Tuple[dict, bool]:
    """In a store no task hosts (etcd): the first task to arrive publishes the cluster, the others read
    its record. Returns (the record, whether this task published it)."""
    mine = publisher_record(cluster, token, who)
    held = store.compare_set(PUBLISHER_KEY, "", mine).decode()
    return json.loads(held), held == mine
