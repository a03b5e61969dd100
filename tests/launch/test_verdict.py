"""The verdict's pieces without processes: failure records and their numbering, which errors are
consequences, what the launcher says for a set of task reports, and which lines are transport noise."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from towerflow.cluster.membership import failures
from towerflow.cluster.membership.failures import FailureRecord, FailureReport
from towerflow.cluster.calls.connection_events import peer_lost
from towerflow.errors import ClusterTimeoutError, ConnectionLost, DataError, PeerLost
from towerflow.launch import verdict

TB = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nRuntimeError: boom\n'


def rec(task: str, seq, cause=None, error="RuntimeError: boom", restart=0, host="here") -> FailureRecord:
    job, index = task.split("/")[1][4:], int(task.split(":")[-1])
    return FailureRecord(task=task, error=error, pid=100 + index, host=host, time=1000.0 + (seq or 0), job=job,
                         index=index, restart=restart, cause=cause, traceback=TB if cause is None else "", seq=seq)


def end(tmp_path, task: str, code, report=None, stopped=False) -> verdict.TaskEnd:
    path = str(tmp_path / f"{task.replace('/', '_')}.json")
    if report is not None:
        report.write(path)
    return verdict.TaskEnd(task, 100, code, stopped, path)


W0, W1, PS = "/job:worker/task:0", "/job:worker/task:1", "/job:ps/task:0"


def test_a_record_and_a_report_survive_json(tmp_path):
    r = rec(W1, 3)
    assert FailureRecord.from_json(r.to_json()) == r
    FailureReport(r, rec(PS, 1)).write(str(tmp_path / "r.json"))
    assert FailureReport.read(str(tmp_path / "r.json")) == FailureReport(r, rec(PS, 1))


@pytest.mark.parametrize("error, cause", [
    (RuntimeError("injected failure"), None),
    (DataError("--data '/x' is not a folder"), None),
    (PeerLost("/job:ps/task:0 failed: RuntimeError: boom", task=PS), PS),
    (peer_lost("the connection from worker:0 to ps:0 at tcp://127.0.0.1:1 closed: its process ended", "ps:0"), ""),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer"), ""),
    (RuntimeError("Connection reset by peer"), None),  # not the transport's: the task's own
    (ClusterTimeoutError("/job:ps/task:0 gave up after 60 s", task=PS, missing=[W1]), W1),
])
def test_which_errors_are_consequences_of_a_lost_peer(error, cause):
    assert failures.cause_of(error) == cause


def test_a_consequence_raised_from_a_lost_peer_follows_the_explicit_cause():
    try:
        try:
            raise peer_lost("the connection from worker:0 to ps:0 at tcp://127.0.0.1:1 closed", "ps:0")
        except ConnectionLost as e:
            raise ValueError("could not push") from e
    except ValueError as e:
        assert failures.cause_of(e) == ""


def test_the_store_numbers_failures_and_the_first_own_one_wins():
    board = failures._Board(dist.HashStore())
    a = board.number(rec(PS, None, cause=W1, error="PeerLost: x"))  # a consequence numbered first
    b = board.number(rec(W1, None))
    c = board.number(rec(W0, None, error="DataError: later"))
    assert (a.seq, b.seq, c.seq) == (1, 2, 3)
    assert board.first() == b


def test_a_failure_of_a_restarted_task_s_older_incarnation_is_not_its_failure():
    store = dist.HashStore()
    board = failures._Board(store)
    old = board.number(rec(W1, None, restart=0))
    board.publish(old)
    assert failures.failure_of(store, "worker", 1) == old
    store.set("incarnation/worker/1", "1")  # the restarted task joined
    assert failures.failure_of(store, "worker", 1) is None and board.first() is None


def test_the_verdict_names_the_first_own_failure_and_one_line_per_other(tmp_path):
    first = rec(W1, 2)
    ends = [
        end(tmp_path, W0, 1, FailureReport(rec(W0, 3, cause=PS, error="PeerLost: lost /job:ps/task:0"), first)),
        end(tmp_path, W1, 1, FailureReport(first, first)),
        end(tmp_path, PS, 1, FailureReport(rec(PS, 1, cause=W1, error="PeerLost: w1 failed"), None)),
    ]
    v = verdict.decide(ends, ends[2], "here", dropped=9)  # the ps exited first: its record says it followed
    assert v.task == W1 and v.exit_code == 1
    lines = v.text.splitlines()
    assert lines[0] == "towerflow launch: /job:worker/task:1 (pid 101 on here) failed first (exit code 1):"
    assert v.text.count("Traceback (most recent call last)") == 1 and "  RuntimeError: boom" in lines
    assert "towerflow launch: /job:worker/task:0 stopped because of it (exit code 1)." in lines
    assert "towerflow launch: /job:ps/task:0 stopped because of it (exit code 1)." in lines
    assert lines[-1].startswith("towerflow launch: left out 9 transport warning(s)")


def test_the_same_error_on_two_tasks_is_reported_once(tmp_path):
    a, b = rec(W1, 1, error="DataError: no data"), rec(W0, 2, error="DataError: no data")
    ends = [end(tmp_path, W0, 1, FailureReport(b, a)), end(tmp_path, W1, 1, FailureReport(a, a))]
    v = verdict.decide(ends, ends[0], "here")
    assert v.task == W1 and v.text.count("Traceback") == 1
    assert "towerflow launch: /job:worker/task:0 also failed on its own (exit code 1): the same error" in v.text


def test_a_remote_first_failure_is_named_from_the_local_task_s_report(tmp_path):
    remote = rec(W1, 1, host="hostb")
    ends = [end(tmp_path, PS, 1, FailureReport(rec(PS, 2, cause=W1, error="PeerLost: w1 failed"), remote))]
    v = verdict.decide(ends, ends[0], "hosta")
    assert v.text.splitlines()[0] == ("towerflow launch: /job:worker/task:1 (pid 101 on hostb) failed first: "
                                      "RuntimeError: boom")
    assert "launch output on hostb" in v.text and "Traceback" not in v.text
    assert "towerflow launch: /job:ps/task:0 stopped because of it (exit code 1)." in v.text


def test_without_reports_the_exit_decides_and_nothing_is_repeated(tmp_path):
    ends = [end(tmp_path, W1, 3), end(tmp_path, W0, -15, stopped=True), end(tmp_path, PS, None, stopped=True)]
    v = verdict.decide(ends, ends[0], "here")
    assert v.exit_code == 3 and v.text.splitlines()[0].startswith(
        "towerflow launch: /job:worker/task:1 (pid 100 on here) failed first: it exited with code 3.")
    assert v.text.splitlines()[1] == "towerflow launch: stopped the other 2 running task(s): /job:worker/task:0, /job:ps/task:0."


def test_unnumbered_failures_are_ordered_by_time_and_it_says_so(tmp_path):
    a, b = dataclasses.replace(rec(W1, None), time=5.0), dataclasses.replace(rec(W0, None), time=4.0)
    ends = [end(tmp_path, W0, 1, FailureReport(b)), end(tmp_path, W1, 1, FailureReport(a))]
    v = verdict.decide(ends, ends[1], "here")
    assert v.task == W0 and "failed first (by time: no store numbered the failures)" in v.text


def test_an_unreadable_report_is_named(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    v = verdict.decide([verdict.TaskEnd(W0, 7, 1, False, str(path))], verdict.TaskEnd(W0, 7, 1, False, str(path)), "h")
    assert f"its failure report {path} is unreadable" in v.text


@pytest.mark.parametrize("line, noise", [
    ("[W1123 16:00:17.671993333 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=5, addr=[::ffff:127.0.0.1]"
     ":46880, remote=[::ffff:127.0.0.1]:33169): Connection reset by peer", True),
    ("[rank1]:[W1123 17:51:07.418216393 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=6, addr=[::ffff:"
     "127.0.0.1]:40134, remote=[::ffff:127.0.0.1]:40345): Connection reset by peer", True),  # once a group is up
    ("[W1123 16:00:17.671993333 TCPStore.cpp:125] [c10d] some other store warning", False),
    ("towerflow: /job:worker/task:0 lost /job:ps/task:0, which failed: RuntimeError: boom", False),
    ("RuntimeError: [c10d] recvValue failed: Connection reset by peer", False),
])
def test_transport_noise_is_recognised_by_its_whole_shape(line, noise):
    assert verdict.is_transport_noise(line) is noise


def test_a_restarted_task_s_failure_is_said_with_the_restart(tmp_path):
    own, consequence = end(tmp_path, W1, 1, FailureReport(rec(W1, 1))), end(tmp_path, PS, 1, FailureReport(rec(
        PS, 2, cause=W1, error="PeerLost: /job:worker/task:1 failed: RuntimeError: boom")))
    assert verdict.restart_note(own.report_path) == ". It failed:\n  " + TB.rstrip().replace("\n", "\n  ")
    assert verdict.restart_note(consequence.report_path) == "; it stopped: /job:worker/task:1 failed: RuntimeError: boom"
    assert verdict.restart_note(str(tmp_path / "none.json")) == ""


def test_what_the_failing_task_itself_prints(monkeypatch):
    first = rec(W1, 1)
    ps = rec(PS, 2, cause=W1, error=f"PeerLost: {W1} failed: RuntimeError: boom")
    w0 = rec(W0, 3, cause=PS, error=f"PeerLost: {W0} lost {PS}, which stopped: {W1} failed: RuntimeError: boom")
    gloo = rec(W0, 3, cause="", error="RuntimeError: lost a peer of its process group (gloo: Connection reset by peer)")
    monkeypatch.setattr(failures, "_report_error", None)
    monkeypatch.setattr(failures, "_board_error", None)
    monkeypatch.setenv(failures.ENV_ERROR_FILE, "/somewhere.json")
    assert failures.describe(ps, first) == f"towerflow: {PS} stopped: {W1} failed: RuntimeError: boom"
    assert failures.describe(w0, first) == f"towerflow: {W0} lost {PS}, which stopped: {W1} failed: RuntimeError: boom"
    assert failures.describe(gloo, first) == (f"towerflow: {W0} stopped: lost a peer of its process group (gloo: "
                                              f"Connection reset by peer) ({W1} failed first: RuntimeError: boom)")
    assert failures.describe(first, first) == (f"towerflow: {W1} failed: RuntimeError: boom; the launcher prints its "
                                               "traceback when the run ends")
    assert failures.describe(rec(W0, 3), first) == f"towerflow: {W0} failed too, after {W1}: RuntimeError: boom"
    monkeypatch.delenv(failures.ENV_ERROR_FILE)  # started by hand: nobody else prints the traceback
    assert failures.describe(first, first) == f"towerflow: {W1} failed:\n{TB.rstrip()}"
    monkeypatch.setattr(failures, "_board_error", "could not record this failure in the cluster's store")
    assert failures.describe(first, None).startswith("towerflow: could not record this failure in the cluster's store\n")


def test_an_error_is_recorded_with_a_short_reason_when_the_transport_lost_a_peer(monkeypatch):
    monkeypatch.setenv("TOWERFLOW_JOB_NAME", "worker")
    monkeypatch.setenv("TOWERFLOW_TASK_INDEX", "0")
    monkeypatch.setenv("TOWERFLOW_RESTART_COUNT", "2")
    r = failures._make(RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:61121: Connection "
                                    "reset by peer. This is typically caused by a remote worker hanging"), None)
    assert (r.task, r.job, r.index, r.restart, r.cause, r.traceback) == (W0, "worker", 0, 2, "", "")
    assert r.error == "RuntimeError: lost a peer of its process group (gloo: Connection reset by peer)"
    gone = failures._make(peer_lost("the connection from worker:0 to ps:0 at tcp://10.0.0.2:7 closed: its process "
                                   "ended", "ps:0"), None)
    assert gone.cause == "" and gone.error == ("ConnectionLost: the connection from worker:0 to ps:0 at tcp://10.0.0.2:7 "
                                               "closed: its process ended")
    own = failures._make(None, TB)
    assert own.is_own and own.error == "RuntimeError: boom" and own.traceback == TB
