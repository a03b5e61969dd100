"""Remote execution: run a Python function on another task of the cluster.

    @towerflow.function
    def sample(n): ...

    with towerflow.device("/job:worker/task:1"):
        value = sample(1000)             # runs on worker 1, returns the value
        future = sample.remote(1000)     # returns at once; future.result() waits
    future = towerflow.remote(sample, 1000, device="/job:ps/task:0/device:CPU:0")

Tensors in the arguments and the result travel as tensors (moved to the CPU for the trip).
The device part of the spec places the work on that task's device. An exception raised
remotely is raised again in the caller as itself, with the remote traceback and the task's
name attached as its cause. Functions defined in the script's `__main__` are sent by value
(cloudpickle, when installed), so a client may send functions the servers never imported.
"""

from __future__ import annotations

import functools
import pickle
import socket
import traceback
from typing import Any, Callable, Optional

import torch

from towerflow.cluster import server as _server
from towerflow.cluster.calls import endpoint as _calls
from towerflow.devices import logical as _logical
from towerflow.devices.spec import DeviceLike, DeviceSpec
from towerflow.errors import ClusterError, ConnectionLost, PeerLost, RemoteError

try:  # ships functions defined in __main__ (or lambdas) by value; optional
    import cloudpickle as _cloudpickle
except ImportError:  # pragma: no cover - depends on the environment
    _cloudpickle = None


class _RemoteTraceback(Exception):
    """The remote side's formatted traceback, set as `__cause__` of the re-raised exception."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class _Failure:
    """What a remote call returns instead of raising, so the caller gets the exception itself back."""

    def __init__(self, task: str, exc: BaseException, tb: str):
        self.task = task
        self.type_name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        self.message = str(exc)
        self.traceback = tb
        try:
            self.exc_bytes = pickle.dumps(exc)
            pickle.loads(self.exc_bytes)
        except Exception:
            self.exc_bytes = None

    def exception(self) -> BaseException:
        header = f"\n\"\"\"\nRemote traceback from {self.task} (host {socket.gethostname()}):\n"
        cause = _RemoteTraceback(header + self.traceback.rstrip() + '\n"""')
        exc = pickle.loads(self.exc_bytes) if self.exc_bytes is not None else None
        if exc is None:
            exc = RemoteError(
                f"{self.type_name}: {self.message} (raised on {self.task})",
                task=self.task,
                remote_type=self.type_name,
                remote_traceback=self.traceback,
            )
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised on {self.task}")
        exc.__cause__ = cause
        return exc


def _unwrap(fn: Callable) -> Callable:
    return getattr(fn, "__wrapped_function__", fn)


def _dumps_fn(fn: Callable) -> bytes:
    """By reference when importable (the remote imports it); by value for `__main__` and lambdas."""
    raw = _unwrap(fn)
    if _cloudpickle is not None and (getattr(raw, "__module__", None) == "__main__" or raw.__name__ == "<lambda>"):
        return _cloudpickle.dumps(raw)
    return pickle.dumps(fn)


def _to_cpu(value: Any) -> Any:
    """Tensors cross processes from the CPU (calls have no device map here); containers are walked."""
    if isinstance(value, torch.Tensor):
        return value.cpu() if value.device.type != "cpu" else value
    if isinstance(value, (list, tuple)):
        out = [_to_cpu(v) for v in value]
        return type(value)(*out) if hasattr(value, "_fields") else type(value)(out)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _run(fn_bytes: Any, device: Optional[str], args: tuple, kwargs: dict) -> Any:
    """Runs on the remote task: unpickle the function, run it under the device scope, send back the result."""
    here = _logical.local_task()
    task = f"/job:{here.job}/task:{here.task}"
    try:
        try:
            fn = _unwrap(pickle.loads(fn_bytes) if isinstance(fn_bytes, bytes) else fn_bytes)
        except Exception as e:
            raise RemoteError(
                f"the function cannot be loaded on {task}: {type(e).__name__}: {e}. Define it in a module that task "
                "can import, or in the script every task runs (or install cloudpickle).",
                task=task,
            ) from None
        if device:
            from towerflow.placement import device as _device_scope

            with _device_scope(device):
                result = fn(*args, **kwargs)
        else:
            result = fn(*args, **kwargs)
        return _to_cpu(result)
    except BaseException as e:  # sent back as a value; re-raised in the caller
        return _Failure(task, e, traceback.format_exc())


class RemoteFuture:
    """The pending result of a remote call: `result()` waits and returns it, or raises what the task raised."""

    def __init__(self, future: torch.futures.Future, task: str, watch=None):
        self._future = future
        self.task = task
        self._watch = watch  # (server, (job, index)): a remote task's heartbeat, watched while waiting

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> Any:
        try:
            if self._watch is not None:  # a task killed or cut off never fails the call: its heartbeat stops
                server, task = self._watch
                server.wait_watching(self._future, task=task)
            value = self._future.wait()
        except ConnectionLost as e:  # the task is gone
            raise PeerLost(f"remote call to {self.task} failed: {e}", task=self.task, incarnation=e.incarnation) from None
        except ClusterError:
            raise
        except Exception as e:  # the call itself failed: timeout
            raise ClusterError(f"remote call to {self.task} failed: {e}", task=self.task) from None
        if isinstance(value, _Failure):
            raise value.exception()
        return value

    wait = result

    def __repr__(self) -> str:
        return f"RemoteFuture({self.task}, {'done' if self.done() else 'pending'})"


def _target(device: DeviceLike, op: str) -> DeviceSpec:
    if device is not None:
        return DeviceSpec.parse(device)
    from towerflow.placement.scope import OpInfo, top

    frame = top()
    return frame.merged_spec(OpInfo(op, "RemoteCall")) if frame is not None else DeviceSpec()


def _is_here(spec: DeviceSpec) -> bool:
    here = _logical.local_task()
    return (spec.job is None or spec.job == here.job) and (spec.task is None or spec.task == here.task)


def _log_call(fn_name: str, spec: DeviceSpec, args: tuple, kwargs: dict) -> None:
    from towerflow.placement.log import PlacementRecord, recorder
    from towerflow import config as _config

    mode = getattr(_config.current(), "log_device_placement", False)
    if not mode:
        return
    nbytes = sum(
        v.numel() * v.element_size() for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)
    )
    device = spec.replace(replica=0, device_type=spec.device_type or "CPU", device_index=spec.device_index or 0)
    record = PlacementRecord(
        op=recorder.unique_name(fn_name), op_type="RemoteCall", device=device.to_string(), bytes_moved=nbytes
    )
    recorder.add(record, emit_line=mode is True)  # "summary" keeps records without printing lines


def remote(fn: Callable, *args: Any, device: DeviceLike = None, **kwargs: Any) -> RemoteFuture:
    """Run fn(*args, **kwargs) on the task named by `device` (or the enclosing `towerflow.device` scope).

    Returns a RemoteFuture. A spec naming this task (or no task) runs here, at once.
    """
    name = getattr(_unwrap(fn), "__name__", "function")
    spec = _target(device, name)
    device_part = spec.device_name if spec.device_type is not None else None
    if spec.job is not None and spec.task is None:
        spec = spec.replace(task=0)  # '/job:ps' means its first task, as in TF
    if _is_here(spec) or (spec.job is None and spec.task is None):
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(_run(fn, device_part, args, kwargs))
        here = _logical.local_task()
        return RemoteFuture(future, f"/job:{here.job}/task:{here.task}")
    server = _server.current()
    task = f"/job:{spec.job or _logical.local_task().job}/task:{spec.task or 0}"
    if server is None or not _calls.is_endpoint_running():
        raise ClusterError(
            f"cannot run {name!r} on {task}: this process is not part of a cluster. Start "
            "towerflow.Server(...) first (or run under `towerflow launch`).",
            task=task,
        )
    job = spec.job or server.job_name
    index = spec.task if spec.task is not None else 0
    server.cluster.task_address(job, index)  # unknown job / index out of range: a clear error
    _log_call(name, spec.replace(job=job, task=index), args, kwargs)
    fut = _calls.call_async(
        server.call_name_of(job, index), _run, args=(_dumps_fn(fn), device_part, _to_cpu(args), _to_cpu(kwargs))
    )
    return RemoteFuture(fut, f"/job:{job}/task:{index}", watch=(server, (job, index)))


class _Function:
    """A function that runs where the enclosing `towerflow.device` scope says, this task or another."""

    def __init__(self, fn: Callable):
        functools.update_wrapper(self, fn)
        self.__wrapped_function__ = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.remote(*args, **kwargs).result()

    def remote(self, *args: Any, device: DeviceLike = None, **kwargs: Any) -> RemoteFuture:
        return remote(self.__wrapped_function__, *args, device=device, **kwargs)

    def __reduce__(self):  # by reference: the remote task finds the decorated function under its name
        return self.__qualname__


def function(fn: Callable) -> _Function:
    """Decorator: calls run on the task of the enclosing `towerflow.device` scope and return the value.

    `f.remote(...)` returns a RemoteFuture instead, so calls to several tasks run in parallel.
    """
    return _Function(fn)
