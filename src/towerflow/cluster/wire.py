"""The frames of one message between tasks: a typed envelope, its pickle, and its tensors as frames.

A message is `[envelope, pickle, *buffer frames]`. The pickle (protocol 5) holds the typed
message (`Call`, `Reply`, `Failure`); every dense tensor in it pickles as its dtype and shape with
its memory as an out-of-band buffer, a frame of its own: sent as it is (ZeroMQ sends frames of
more than 64 KB without a copy) and received as a tensor over the frame's buffer (no copy
either). Other out-of-band buffers (numpy arrays) travel the same way. Tensors on a GPU are copied to the host
first; they arrive on the host.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import pickle
import struct
from typing import Any, List, Optional, Sequence, Tuple

import torch

from towerflow.errors import RemoteError

CALL, REPLY, FAILURE = 1, 2, 3  # the envelope's kind
ANSWERS_LATER = "_towerflow_deferred"  # set on a call target by `deferred`
ANSWERS_AT_ONCE = "_towerflow_quick"  # set on a call target by `quick`


def deferred(fn):
    """Mark a call target that returns a torch Future: the reply goes out when it completes, and it runs on
    the serving task's socket thread, so it must not block (it returns at once and completes later)."""
    setattr(fn, ANSWERS_LATER, True)
    return fn


def quick(fn):
    """Mark a call target that never waits and returns in well under a millisecond's work per call: it runs
    on the serving task's socket thread instead of a pool thread, saving two thread hand-offs per call
    (a third of a small call's cost). It must not call another task or wait on anything."""
    setattr(fn, ANSWERS_AT_ONCE, True)
    return fn

_ENVELOPE = struct.Struct("<BQI")  # kind, call id, number of tensor frames


@dataclasses.dataclass(frozen=True)
class Call:
    """A request: run `fn(*args, **kwargs)` on the receiving task."""

    fn: Any
    args: tuple = ()
    kwargs: Optional[dict] = None


@dataclasses.dataclass(frozen=True)
class Reply:
    """What the called function returned (a deferred one: what its future completed with)."""

    value: Any


@dataclasses.dataclass(frozen=True)
class Failure:
    """The called function raised: the exception itself when it pickles, else its type name and text."""

    error: Optional[BaseException]
    type_name: str
    text: str
    remote_traceback: str

    def exception(self, task: str) -> BaseException:
        if self.error is not None:
            return self.error
        return RemoteError(f"{self.type_name} on {task}: {self.text}", task=task, remote_type=self.type_name,
                           remote_traceback=self.remote_traceback)


_KIND_OF = {Call: CALL, Reply: REPLY, Failure: FAILURE}


def _rebuild(data: Any, dtype: torch.dtype, shape: tuple, requires_grad: bool, is_parameter: bool) -> torch.Tensor:
    """A received tensor over its frame's memory (or an empty one)."""
    if len(data) == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        tensor = torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _reduce_tensor(obj: torch.Tensor):
    """A dense tensor pickles as its shape and dtype, its memory as an out-of-band buffer (its own frame)."""
    if obj.layout != torch.strided:
        return obj.__reduce_ex__(5)  # a sparse tensor: its index and value tensors come back here
    tensor = obj.detach() if obj.requires_grad else obj
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.numel() == 0:
        data: Any = b""
    elif tensor.dtype in _NUMPY_DTYPES:
        data = pickle.PickleBuffer(tensor.numpy())
    else:  # bfloat16 and the like have no numpy dtype: their bytes
        data = pickle.PickleBuffer(tensor.reshape(-1).view(torch.uint8).numpy())
    return (_rebuild, (data, tensor.dtype, tuple(obj.shape), obj.requires_grad, isinstance(obj, torch.nn.Parameter)))


_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})
_REDUCERS = {torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor}


def encode(call_id: int, message: Any) -> List[Any]:
    """The frames of `message` (a `Call`, `Reply` or `Failure`): envelope, pickle, then one frame per tensor
    (and per out-of-band buffer of pickle protocol 5, a numpy array's for example)."""
    buffers: List[Any] = []
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5, buffer_callback=lambda b: buffers.append(b.raw()))
    pickler.dispatch_table = {**copyreg.dispatch_table, **_REDUCERS}  # by exact type, in C: the rest at full speed
    with torch._C.DisableTorchFunction():  # the copies to the host are the wire's, not ops of a placement scope
        pickler.dump(message)
    return [_ENVELOPE.pack(_KIND_OF[type(message)], call_id, len(buffers)), out.getbuffer(), *buffers]


def envelope(frame: Any) -> Tuple[int, int, int]:
    """(kind, call id, number of buffer frames) of a message's first frame."""
    return _ENVELOPE.unpack_from(getattr(frame, "buffer", frame))


def decode(frames: Sequence[Any]) -> Any:
    """The message of `frames` (without the envelope's routing frames): tensors over the frames' memory."""
    body = getattr(frames[1], "buffer", frames[1])
    with torch._C.DisableTorchFunction():
        return pickle.loads(body, buffers=[getattr(f, "buffer", f) for f in frames[2:]])


def failure_of(error: BaseException, remote_traceback: str) -> Failure:
    """The `Failure` to send for `error`: the exception itself when it survives pickling."""
    try:
        pickle.loads(pickle.dumps(error))
        kept: Optional[BaseException] = error
    except Exception:
        kept = None
    return Failure(kept, type(error).__name__, str(error), remote_traceback)
