"""The first connections to the rendezvous store: a cluster's tasks knock at once, on a store host that may be
short of CPU; each gets in, or an error that says what it waited for and how long."""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest

from towerflow.cluster.store import c10d
from towerflow.errors import ClusterJoinError


def test_a_port_that_accepts_but_never_answers_is_named_within_the_wait():
    silent = c10d.listen("127.0.0.1", 0)  # accepts (the kernel does) and never says a word
    try:
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(ClusterJoinError, match=rf"the store at 127.0.0.1:{port} accepted a connection but gave no "
                                                   r"answer within 1 s .*TOWERFLOW_JOIN_TIMEOUT"):
            c10d.connect_store("127.0.0.1", port, timeout=5, answer_within=1)
        assert time.monotonic() - start < 3
    finally:
        silent.close()


def test_a_store_that_starts_answering_late_is_still_joined():
    """Connections reset at first (a store host that is not serving yet), then the store comes: joined."""
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen(16)
    port = holder.getsockname()[1]
    served = {}

    def reset_then_serve():
        holder.settimeout(0.05)
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            try:
                conn, _ = holder.accept()
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()  # a reset
            except socket.timeout:
                pass
        holder.close()
        served["store"] = c10d.host_store(c10d.listen("127.0.0.1", port), 10)

    threading.Thread(target=reset_then_serve, daemon=True).start()
    client = c10d.connect_store("127.0.0.1", port, timeout=10)
    client.set("joined", "yes")
    assert served["store"].get("joined") == b"yes"


def test_many_tasks_connecting_at_the_same_instant_all_get_in():
    store = c10d.host_store(c10d.listen("127.0.0.1", 0), 30)
    port = store.port
    go, results = threading.Event(), []

    def task(i):
        go.wait()
        try:
            c10d.connect_store("127.0.0.1", port, timeout=30).add("joined", 1)
            results.append(i)
        except Exception as e:  # collected: the assertion names them
            results.append(e)

    threads = [threading.Thread(target=task, args=(i,), daemon=True) for i in range(64)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(60)
    assert sorted(r for r in results if isinstance(r, int)) == list(range(64)), results
    assert store.add("joined", 0) == 64


def test_a_connection_that_waited_on_the_name_resolver_says_so(monkeypatch, caplog):
    """A resolver that does not answer torch's lookup of the client's own address costs each connection its timeout
    (5 s): the join is slow for no reason the user can see, so the connection says where to look."""
    store = c10d.host_store(c10d.listen("127.0.0.1", 0), 30)
    connect = c10d.dist.TCPStore

    def slow_lookup(*args, **kwargs):
        time.sleep(0.3)
        return connect(*args, **kwargs)

    monkeypatch.setattr(c10d.dist, "TCPStore", slow_lookup)
    monkeypatch.setattr(c10d, "SLOW_CONNECT", 0.2)
    with caplog.at_level("WARNING", logger="towerflow"):
        c10d.connect_store("127.0.0.1", store.port, timeout=10).set("joined", "yes")
    assert store.get("joined") == b"yes"
    assert re.search(rf"connecting to the store at 127.0.0.1:{store.port} took 0\.\d s: .*name resolver.*/etc/hosts",
                     caplog.text), caplog.text
