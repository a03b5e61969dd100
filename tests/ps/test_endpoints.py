"""A call to a ps task runs on that task's one `ServedModels`: made once, by the ps's program or by the first call,
and kept while the task's endpoint serves."""

from __future__ import annotations

import types

import pytest

from towerflow.cluster.calls import endpoint as _calls
from towerflow.errors import ClusterError
from towerflow.ps.server import endpoints


def test_a_call_runs_on_the_served_models_the_task_made_once(monkeypatch):
    monkeypatch.setattr(_calls, "_current", types.SimpleNamespace(served={}))  # an endpoint serving, no sockets
    served = endpoints.served_here(types.SimpleNamespace(name="/job:ps/task:0"))
    assert endpoints.served_here(types.SimpleNamespace(name="/job:ps/task:1")) is served
    holds = endpoints.endpoint("holds")
    assert holds("model") is False
    served._services["model"] = object()
    assert holds("model") is True


def test_the_first_call_makes_the_served_models_of_a_task_no_program_made_them_for(monkeypatch):
    monkeypatch.setattr(_calls, "_current", types.SimpleNamespace(served={}))
    monkeypatch.setattr(endpoints._server, "current", lambda: types.SimpleNamespace(name="/job:ps/task:3"))
    assert endpoints.endpoint("holds")("model") is False
    assert endpoints.served_here(types.SimpleNamespace(name="other"))._server.name == "/job:ps/task:3"


def test_a_process_that_serves_no_endpoint_has_no_served_models(monkeypatch):
    monkeypatch.setattr(_calls, "_current", None)
    with pytest.raises(ClusterError, match="ServedModels: it serves no endpoint"):
        endpoints.endpoint("holds")("model")
