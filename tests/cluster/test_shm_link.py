"""cluster/link/shm_link.py: a same-host request/reply link whose tensors live in shared memory.

Both ends run in this process (the server end in its thread, as a ps task runs it); the files live
in a temporary folder instead of /dev/shm, which changes nothing else.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from towerflow.cluster.link import shm_link
from towerflow.errors import ConnectionLost

SPECS = ((5, torch.float32), (3, torch.float64))


def _double(header, requests, replies):
    """The server's work: reply = 2 * request, header echoed with a mark."""
    for r, q in zip(replies, requests):
        r.copy_(q * 2)
    done = torch.futures.Future()
    done.set_result(("done", header))
    return done


def _linked(tmp_path, handler=_double):
    client = shm_link.LinkClient(SPECS, SPECS, directory=str(tmp_path))
    assert shm_link.serve(client.offer, handler)
    client.connect()
    return client


def test_a_call_sees_the_request_tensors_and_returns_the_reply_tensors(tmp_path):
    client = _linked(tmp_path)
    for step in range(5):  # both slots, several times: the tensors are reused, never re-sent
        slot = step % shm_link.SLOTS
        for t in client.requests[slot]:
            t.copy_(torch.arange(t.numel(), dtype=t.dtype) + step)
        client.call(slot, {"step": step})
        assert client.reply(slot) == ("done", {"step": step})
        for q, r in zip(client.requests[slot], client.replies[slot]):
            torch.testing.assert_close(r, q * 2)
    client.close()


def test_no_file_is_left_behind_once_both_ends_are_open(tmp_path):
    client = _linked(tmp_path)
    assert os.listdir(tmp_path) == []
    client.close()


def test_an_error_on_the_server_reaches_the_caller_as_itself(tmp_path):
    def fails(header, requests, replies):
        raise ValueError(f"bad header {header!r}")

    client = _linked(tmp_path, fails)
    client.call(0, 7)
    with pytest.raises(ValueError, match="bad header 7"):
        client.reply(0)
    client.close()


def test_a_server_whose_end_closes_fails_the_pending_call_as_a_lost_peer(tmp_path):
    # a server that never answers; then its end of the reply pipe closes (as when its process dies)
    client = shm_link.LinkClient(SPECS, SPECS, directory=str(tmp_path))
    reply_fd = os.open(client.offer.path("out"), os.O_WRONLY | os.O_NONBLOCK)
    client.connect()
    client.call(0, "hello")
    os.close(reply_fd)
    with pytest.raises(ConnectionLost) as info:
        client.reply(0)
    assert isinstance(info.value, ConnectionLost), "the ps client must treat a closed link as a lost ps task"
    with pytest.raises(ConnectionLost):
        client.call(1, "again")
    client.close()


def test_a_slot_in_flight_is_not_reused(tmp_path):
    never = torch.futures.Future()
    client = _linked(tmp_path, lambda header, q, r: never)
    client.call(0, "first")
    with pytest.raises(RuntimeError, match="slot 0 .* still in flight"):
        client.call(0, "second")
    client.close()


def test_replies_are_matched_to_their_slots_whatever_their_order(tmp_path):
    held = {}

    def answer_later(header, requests, replies):
        held[header] = torch.futures.Future()
        if header == "second":  # the second call is answered first, then the first
            held["second"].set_result("for second")
            held["first"].set_result("for first")
        return held[header]

    client = _linked(tmp_path, answer_later)
    client.call(0, "first")
    client.call(1, "second")
    assert client.reply(1) == "for second" and client.reply(0) == "for first"
    client.close()


def test_waiting_runs_the_idle_check_and_stops_when_it_raises(tmp_path):
    never = torch.futures.Future()
    client = _linked(tmp_path, lambda header, q, r: never)
    client.call(0, "stuck")
    checks = []

    def idle():
        checks.append(1)
        if len(checks) == 3:
            raise TimeoutError("a peer went silent")

    with pytest.raises(TimeoutError, match="went silent"):
        client.reply(0, idle=idle, every=0.01)
    assert len(checks) == 3
    client.close()


def test_an_offer_from_another_host_is_declined(tmp_path):
    client = shm_link.LinkClient(SPECS, SPECS, directory=str(tmp_path))
    elsewhere = shm_link.LinkOffer(str(tmp_path / "not-here"), SPECS, SPECS)  # files this host does not have
    assert shm_link.serve(elsewhere, _double) is False
    assert not (tmp_path / "not-here.q0.0").exists(), "declining must not create the files"
    client.close()


@pytest.mark.parametrize("a, b, same", [("vm:2222", "vm:2223", True), ("10.0.0.1:1", "10.0.0.2:1", False),
                                        ("[::1]:5", "[::1]:6", True), ("hosta:1", "hostb:1", False)])
def test_same_host_compares_the_host_part_of_addresses(a, b, same):
    assert shm_link.same_host(a, b) is same


def test_a_link_that_does_not_fit_fails_at_once_and_leaves_nothing(tmp_path, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OSError, match="No space left"):
        shm_link.LinkClient(SPECS, SPECS, directory=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_link_dropped_unclosed_hangs_up_on_its_server(tmp_path):
    """A caller whose thread ended without closing its link (a ps's link thread to a part given back): the server's
    loop still sees the end, and its `on_end` runs."""
    ended = threading.Event()
    client = shm_link.LinkClient(SPECS, SPECS, directory=str(tmp_path))
    assert shm_link.serve(client.offer, _double, on_end=ended.set)
    client.connect()
    del client
    gc.collect()
    assert ended.wait(10), "the server's loop never saw the link end"


def test_a_process_that_stops_serving_hangs_up_on_its_callers_and_may_serve_again(tmp_path):
    """A ps task leaving its cluster (its store lost, say) stops its links with its messaging: a worker stepping over
    one sees the server gone, as when the process dies, instead of answers that fail for want of an endpoint."""
    client = _linked(tmp_path)
    shm_link.stop_servers()
    with pytest.raises(ConnectionLost, match="server is gone"):
        client.call(0, {"step": 0})
        client.reply(0)
    client.close()
    again = _linked(tmp_path)  # a link served afterwards has a wake pipe of its own
    again.call(0, {"step": 1})
    assert again.reply(0) == ("done", {"step": 1})
    again.close()


def test_a_forked_child_ending_leaves_its_parents_links_served(tmp_path):
    """Tasks are forked from a fork server that imported this module: a child's exit must wake only its own
    serving loops, never its parent's or its siblings'."""
    client = _linked(tmp_path)
    parent_wake = shm_link._process_wake()
    pid = os.fork()
    if pid == 0:  # the child: what its atexit would do, then its own wake pipe
        code = 0
        try:
            shm_link.stop_servers()
            own = shm_link._process_wake()
            code = 0 if own is not parent_wake and own.pid == os.getpid() else 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for step in range(3):  # the parent's link still answers
        slot = step % shm_link.SLOTS
        client.call(slot, {"step": step})
        assert client.reply(slot) == ("done", {"step": step})
    client.close()


def test_the_after_hook_runs_once_each_call_is_answered(tmp_path):
    """What a server does while its caller computes (a ps reading its backup's acks) runs after each reply."""
    ran = threading.Semaphore(0)
    client = shm_link.LinkClient(SPECS, SPECS, directory=str(tmp_path))
    assert shm_link.serve(client.offer, _double, after=ran.release)
    client.connect()
    for step in range(3):
        slot = step % shm_link.SLOTS
        client.call(slot, {"step": step})
        assert client.reply(slot) == ("done", {"step": step})
        assert ran.acquire(timeout=10)
    assert not ran.acquire(blocking=False)  # once per call
    client.close()
