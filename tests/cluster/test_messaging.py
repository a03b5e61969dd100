"""The messaging layer alone: two endpoints, what crosses, what fails and how, who is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from towerflow.cluster.calls import messaging
from towerflow.errors import ConnectionLost
from towerflow.cluster.calls.wire_security import AUTHENTICATE, ENCRYPT, WireSecurity
from towerflow.errors import ClusterJoinError, ClusterTimeoutError, RemoteError

_calls_run = []
_never: list = []
_unpickled = []


def _echo(*args, **kwargs):
    _calls_run.append(1)
    return args, kwargs


@messaging.deferred
def _later(value):
    future = torch.futures.Future()
    _never.append((future, value))
    return future


@messaging.deferred
def _never_answers():
    future = torch.futures.Future()
    _never.append((future, None))
    return future


def _thread_name():
    import threading
    return threading.current_thread().name


@messaging.quick
def _quick_thread_name():
    return _thread_name()


def _raises(kind: str):
    if kind == "value":
        raise ValueError("the bad value 7")

    class Local(Exception):  # a class pickle cannot find by name
        pass

    raise Local("not picklable")


class _Tripwire:
    """Unpickling it leaves a mark: a message from a stranger must never get that far."""

    def __reduce__(self):
        return (_unpickled.append, ("unpickled",))


@pytest.fixture
def endpoints():
    made = []

    def make(name, token="t", mode=AUTHENTICATE, book=None):
        ep = messaging.Endpoint(name, "127.0.0.1", WireSecurity(mode, token), lambda peer: (book or {}).get(peer), 10.0)
        made.append(ep)
        return ep

    yield make
    for ep in made:
        ep.close()
    _never.clear()
    _calls_run.clear()
    _unpickled.clear()


@pytest.mark.parametrize("mode", [AUTHENTICATE, ENCRYPT])
def test_tensors_of_every_kind_arrive_as_they_were_sent(endpoints, mode):
    server = endpoints("server", mode=mode)
    client = endpoints("client", mode=mode, book={"server": server.address})
    weight = torch.nn.Parameter(torch.randn(3, 2))
    sent = {
        "bf16": torch.randn(5, 4).to(torch.bfloat16),
        "bool": torch.tensor([True, False]),
        "int64": torch.arange(6).reshape(2, 3),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 7),
        "strided": torch.arange(20.).reshape(4, 5).t(),
        "grad": torch.ones(2, requires_grad=True),
        "big": torch.randn(300_000),  # over ZeroMQ's copy threshold: sent from the tensor's own memory
        "sparse": torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,), check_invariants=True),
    }
    (args, kwargs) = client.call("server", _echo, (weight,), sent).wait()
    assert isinstance(args[0], torch.nn.Parameter) and torch.equal(args[0], weight) and args[0].requires_grad
    for name, tensor in sent.items():
        got = kwargs[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got.to_dense(), tensor.detach().to_dense()), name
    assert kwargs["grad"].requires_grad and not kwargs["int64"].requires_grad


def test_a_deferred_call_is_answered_when_its_future_completes(endpoints):
    server = endpoints("server")
    client = endpoints("client", book={"server": server.address})
    reply = client.call("server", _later, (41,))
    deadline = time.monotonic() + 5
    while not _never and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not reply.done()
    future, value = _never[0]
    future.set_result(value + 1)
    assert reply.wait() == 42


def test_a_quick_call_is_answered_by_the_socket_thread_and_any_other_by_a_pool_thread(endpoints):
    server = endpoints("server")
    client = endpoints("client", book={"server": server.address})
    assert client.call("server", _quick_thread_name).wait() == "towerflow-messaging server"
    assert client.call("server", _thread_name).wait().startswith("towerflow-call server")
    channel = client.direct("server")
    try:
        assert channel.call(_quick_thread_name).result() == "towerflow-messaging server"
    finally:
        channel.close()


def test_the_remote_exception_comes_back_as_itself_or_as_a_remote_error_naming_it(endpoints):
    server = endpoints("server")
    client = endpoints("client", book={"server": server.address})
    with pytest.raises(ValueError, match="the bad value 7"):
        client.call("server", _raises, ("value",)).wait()
    with pytest.raises(RemoteError, match="Local on server: not picklable") as e:
        client.call("server", _raises, ("local",)).wait()
    assert "raise Local" in e.value.remote_traceback


def test_a_lost_connection_stays_lost_until_reconnect_opens_a_new_one(endpoints):
    """A task's name is never reused, so a lost connection fails every later call at once; `reconnect` is for a
    task that may live on behind a cut (a network partition): the next call opens a new connection."""
    book = {}
    client = endpoints("client", book=book)
    first = endpoints("server")
    book["server"] = first.address
    assert client.call("server", _echo, (1,), timeout=10).wait()[0] == (1,)
    first.close()
    with pytest.raises(ConnectionLost):
        client.call("server", _echo, (2,), timeout=10).wait()
    book["server"] = endpoints("server").address  # the same task, reachable again (here: at another address)
    with pytest.raises(ConnectionLost):
        client.call("server", _echo, (3,), timeout=10).wait()
    client.reconnect("server")
    assert client.call("server", _echo, (4,), timeout=10).wait()[0] == (4,)


def test_a_call_to_a_name_nobody_published_fails_at_once_as_a_lost_peer(endpoints):
    client = endpoints("client")
    with pytest.raises(ConnectionLost, match="no task named 'ps:0:r3' has joined"):
        client.call("ps:0:r3", _echo).wait()


def test_a_call_past_its_deadline_fails_naming_the_task(endpoints):
    server = endpoints("server")
    client = endpoints("client", book={"server": server.address})
    start = time.monotonic()
    with pytest.raises(ClusterTimeoutError, match="to server got no reply within its deadline"):
        client.call("server", _never_answers, timeout=0.5).wait()
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("mode", [AUTHENTICATE, ENCRYPT])
def test_a_peer_with_another_token_is_refused_before_anything_is_unpickled(endpoints, mode, capfd):
    server = endpoints("server", token="right", mode=mode)
    stranger = endpoints("stranger", token="wrong", mode=mode, book={"server": server.address})
    with pytest.raises(ClusterJoinError, match="server at tcp://127.0.0.1:.* refused the connection of stranger"):
        stranger.call("server", _echo, (_Tripwire(),), timeout=10).wait()
    assert _calls_run == [] and _unpickled == []
    if mode == AUTHENTICATE:  # CURVE refuses a wrong key in the handshake itself, before the gate is asked
        assert "server: refused a connection from 127.0.0.1" in capfd.readouterr().err
    friend = endpoints("friend", token="right", mode=mode, book={"server": server.address})
    friend.call("server", _echo, (1,), timeout=10).wait()
    assert _calls_run == [1]


class _QueuesOnlyWhenConnected(messaging.Endpoint):
    """Its connections take a call only once connected (ZMQ_IMMEDIATE), so every send meets a socket
    that cannot queue it yet: what a connection being made, or refused and retried, looks like."""

    def _configure_dealer(self, socket, address):
        super()._configure_dealer(socket, address)
        socket.immediate = True


@pytest.mark.parametrize("token, outcome", [("t", "answered"), ("wrong", "refused")])
def test_a_call_the_connection_cannot_take_yet_waits_for_it_without_blocking_the_endpoint(endpoints, token, outcome):
    server = endpoints("server")
    client = _QueuesOnlyWhenConnected("client", "127.0.0.1", WireSecurity(AUTHENTICATE, token),
                                      {"server": server.address}.get, 10.0)
    try:
        calls = [client.call("server", _echo, (i,), timeout=10) for i in range(3)]
        if outcome == "answered":
            assert [c.wait()[0] for c in calls] == [(0,), (1,), (2,)]  # all of them, in order
        else:
            for c in calls:
                with pytest.raises(ClusterJoinError, match="refused the connection of client"):
                    c.wait()
        direct = client.direct("server")
        if outcome == "answered":
            assert direct.call(_echo, 7).result()[0] == (7,)
        else:
            with pytest.raises(ClusterJoinError, match="refused the connection of client"):
                direct.call(_echo, 7).result()
        direct.close()
    finally:
        client.close()


def test_a_call_after_close_fails_instead_of_waiting(endpoints):
    client = endpoints("client")
    client.close()
    with pytest.raises(ConnectionLost, match="has left the cluster"):
        client.call("server", _echo).wait()


_PEER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from towerflow.cluster.calls import messaging
    from towerflow.cluster.calls.wire_security import WireSecurity
    import test_messaging
    ep = messaging.Endpoint("peer", "127.0.0.1", WireSecurity("authenticate", "t"), lambda n: None, 10.0)
    print(ep.address, flush=True)
    time.sleep(120)
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize("moment", ["waiting on a reply", "before the first call"])
def test_a_killed_peer_fails_the_calls_waiting_on_it_and_the_next_ones(endpoints, moment):
    code = _PEER.format(tests=os.path.dirname(__file__))
    peer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        address = peer.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:")
        client = endpoints("client", book={"peer": address})
        if moment == "waiting on a reply":
            waiting = client.call("peer", _never_answers)
            time.sleep(0.5)
            assert not waiting.done()
        peer.send_signal(signal.SIGKILL)
        peer.wait(10)
        start = time.monotonic()
        if moment == "waiting on a reply":
            with pytest.raises(ConnectionLost, match="connection from client to peer .* closed"):
                waiting.wait()
        with pytest.raises(ConnectionLost, match="peer"):
            client.call("peer", _echo).wait()
        assert time.monotonic() - start < 5
    finally:
        peer.kill()
        peer.wait(10)



def test_a_connection_that_cannot_be_opened_fails_its_call_and_the_endpoint_goes_on(endpoints):
    server = endpoints("server")
    client = endpoints("client", book={"server": server.address, "bad": "tcp://127.0.0.1:notaport"})
    with pytest.raises(ConnectionLost, match="could not open a connection to bad at tcp://127.0.0.1:notaport"):
        client.call("bad", _echo, (1,), timeout=10).wait()
    assert client.call("server", _echo, (2,), timeout=10).wait() == ((2,), {})


def test_a_direct_channel_dropped_unclosed_stops_its_monitor_before_its_sockets_close(endpoints):
    """A thread that ends holding a channel drops it unclosed: its sockets must still be closed monitor-safe
    (libzmq's I/O thread blocks for good on an event for a monitor closed first)."""
    import gc

    server = endpoints("server")
    client = endpoints("client", book={"server": server.address})
    channel = client.direct("server")
    assert channel.call(_echo, 1).result()[0] == (1,)
    dealer = channel._socket
    del channel
    gc.collect()
    assert dealer.closed and dealer._monitor_socket is None


def test_a_monitor_closed_before_its_socket_after_stop_monitors_blocks_no_connection(endpoints):
    """What a context destroyed with another thread's channel still open may do: close the monitor first, then
    the monitored connection's task dies. After `stop_monitors` (an endpoint's close runs it before the destroy)
    the disconnect goes nowhere and the task's other connections work on; without it every one would hang."""
    from towerflow.cluster.calls.connection_events import stop_monitors

    server, other = endpoints("server"), endpoints("other")
    client = endpoints("client", book={"server": server.address, "other": other.address})
    channel = client.direct("server")
    assert channel.call(_echo, 1).result()[0] == (1,)
    stop_monitors(client._context)
    channel._monitor.close(0)
    server.close()  # the task at the channel's other end dies: a disconnect event
    time.sleep(0.5)
    assert client.call("other", _echo, (2,), timeout=5).wait() == ((2,), {})
    channel._socket.close(0)


class _RetriesEveryMillisecond(messaging.Endpoint):
    """Its connections retry a refused connect every millisecond: a dead task's reconnect events, 100x faster."""

    def _configure_dealer(self, socket, address):
        super()._configure_dealer(socket, address)
        socket.reconnect_ivl = 1


def test_a_channel_to_a_dead_task_left_unread_blocks_no_other_connection(endpoints, free_ports):
    """A thread holding a channel to a task that died, and not calling on it (its worker waits elsewhere), leaves
    the reconnect events unread: thousands of them must not stop the task's other connections."""
    server = endpoints("server")
    dead = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    client = _RetriesEveryMillisecond("client", "127.0.0.1", WireSecurity(AUTHENTICATE, "t"),
                                      {"server": server.address, "dead": dead}.get, 10.0)
    try:
        channel = client.direct("dead")
        time.sleep(4)  # about 4,000 events at one a millisecond; libzmq's default queue holds 2,000
        assert client.call("server", _echo, (1,), timeout=5).wait() == ((1,), {})
        channel.close()
    finally:
        client.close()
