"""towerflow.function / towerflow.remote without a cluster: local runs, errors, exceptions as themselves."""

from __future__ import annotations

import pytest
import torch

import towerflow
from towerflow.cluster.remote import _Failure


@towerflow.function
def double(t):
    return t * 2, str(torch.zeros(1).device)


@towerflow.function
def fail(kind):
    if kind == "value":
        raise ValueError("no good")
    raise _Unpicklable()


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("cannot pickle me")


def test_a_function_outside_any_task_scope_runs_here():
    out, device = double(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 2.0)) and device == "cpu"


def test_a_spec_naming_this_task_runs_here_with_its_device_part():
    with towerflow.device("/job:localhost/task:0/device:CPU:0"):
        assert double(torch.ones(1))[1] == "cpu"
    future = towerflow.remote(double, torch.ones(1), device="/cpu:0")
    assert future.done() and torch.equal(future.result()[0], torch.full((1,), 2.0))


def test_another_task_without_a_server_is_a_clear_error():
    t = torch.ones(1)  # made here: tensor ops inside a scope naming another task are PlacementErrors
    with pytest.raises(towerflow.ClusterError, match=r"cannot run 'double' on /job:worker/task:1: this process is not part of a cluster"):
        with towerflow.device("/job:worker/task:1"):
            double(t)


def test_an_exception_comes_back_as_itself_with_the_task_and_traceback():
    with pytest.raises(ValueError, match="no good") as e:
        fail("value")
    cause = str(e.value.__cause__)
    assert "Remote traceback from /job:localhost/task:0" in cause and 'raise ValueError("no good")' in cause


def test_an_unpicklable_exception_arrives_as_remote_error():
    failure = _Failure("/job:ps/task:0", _Unpicklable("x"), "Traceback ...\n_Unpicklable: x")
    err = failure.exception()
    assert isinstance(err, towerflow.RemoteError)
    assert err.task == "/job:ps/task:0" and err.remote_type.endswith("_Unpicklable") and "raised on /job:ps/task:0" in str(err)
