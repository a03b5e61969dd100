"""How a started task leaves at exit: after a recorded failure it aborts (the others must not wait for it) and ends
at once with exit status 1, whatever the abort did, skipping an interpreter teardown that crashed with threads still
inside torch and pyzmq; without a failure it joins the others and the interpreter ends as usual."""

from __future__ import annotations

import types

import pytest

from towerflow.cluster import exit_hooks


class _Exited(Exception):
    pass


@pytest.fixture
def leave(monkeypatch):
    """The exit hook `leave_at_exit` registers, with the failure record, the process's exit and the cluster's calls
    faked; returns (call it, what happened)."""
    happened = []
    hooks = []
    record = types.SimpleNamespace(failure=None)
    monkeypatch.setattr(exit_hooks.atexit, "register", hooks.append)
    monkeypatch.setattr(exit_hooks, "install", lambda: None)
    monkeypatch.setattr(exit_hooks._failures, "attach", lambda store, task: None)
    monkeypatch.setattr(exit_hooks._failures, "recorded", lambda: record.failure)

    def exit_now(code):
        happened.append(("exit", code))
        raise _Exited()

    monkeypatch.setattr(exit_hooks.os, "_exit", exit_now)

    def make(abort_fails=False):
        def abort(why):
            happened.append(("abort", why))
            if abort_fails:
                raise RuntimeError("the store is gone too")

        exit_hooks.leave_at_exit(object(), abort=abort, join=lambda: happened.append(("join",)))
        return hooks[-1]

    return make, happened, record


def test_a_failed_task_aborts_then_ends_at_once_with_status_1(leave):
    make, happened, record = leave
    record.failure = types.SimpleNamespace(error="ValueError: bad batch")
    with pytest.raises(_Exited):
        make()()
    assert happened == [("abort", "ValueError: bad batch"), ("exit", 1)]


def test_a_failed_task_whose_abort_fails_still_ends_at_once(leave):
    make, happened, record = leave
    record.failure = types.SimpleNamespace(error="lost the cluster's store")
    with pytest.raises(_Exited):
        make(abort_fails=True)()
    assert happened == [("abort", "lost the cluster's store"), ("exit", 1)]


def test_a_task_without_a_failure_joins_and_exits_as_usual(leave):
    make, happened, _ = leave
    make()()
    assert happened == [("join",)]
