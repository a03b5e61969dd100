"""The frames of one message between tasks: a typed envelope, its pickle, and its tensors as frames.

A message is `[envelope, pickle, *tensor frames, *buffer frames]`. The pickle holds the typed
message (`Call`, `Reply`, `Failure`) with every dense tensor replaced by a reference to a frame
of its own: its memory is sent as it is (ZeroMQ sends frames of more than 64 KB without a copy)
and received as a tensor over the frame's buffer (no copy either). Pickle protocol 5's
out-of-band buffers (numpy arrays) travel the same way. Tensors on a GPU are copied to the host
first; they arrive on the host, as they did with torch RPC without a device map.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import struct
from typing import Any, List, Optional, Sequence, Tuple

import torch

from towerflow.errors import RemoteError

CALL, REPLY, FAILURE = 1, 2, 3  # the envelope's kind
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


class _TensorPickler(pickle.Pickler):
    """Replaces each dense tensor by (frame index, dtype, shape, requires_grad, is a Parameter)."""

    def __init__(self, file, frames: List[Any]):
        super().__init__(file, protocol=5, buffer_callback=self._out_of_band)
        self.tensors: List[memoryview] = []
        self.buffers: List[Any] = frames

    def _out_of_band(self, buffer: pickle.PickleBuffer) -> None:
        self.buffers.append(buffer.raw())

    def persistent_id(self, obj: Any) -> Optional[tuple]:
        if not isinstance(obj, torch.Tensor) or obj.layout != torch.strided:
            return None  # a sparse tensor pickles as its index and value tensors, which come back here
        tensor = obj.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        self.tensors.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b"")
        return ("t", len(self.tensors) - 1, tensor.dtype, tuple(obj.shape), obj.requires_grad,
                isinstance(obj, torch.nn.Parameter))


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file, tensor_frames: Sequence[Any], buffers: Sequence[Any]):
        super().__init__(file, buffers=buffers)
        self.frames = tensor_frames

    def persistent_load(self, pid: tuple) -> torch.Tensor:
        _, index, dtype, shape, requires_grad, is_parameter = pid
        frame = self.frames[index]
        data = getattr(frame, "buffer", frame)
        if len(data) == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            tensor = torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)
        if is_parameter:
            return torch.nn.Parameter(tensor, requires_grad=requires_grad)
        return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def encode(call_id: int, message: Any) -> List[Any]:
    """The frames of `message` (a `Call`, `Reply` or `Failure`): envelope, pickle, tensors, buffers."""
    buffers: List[Any] = []
    out = io.BytesIO()
    pickler = _TensorPickler(out, buffers)
    with torch._C.DisableTorchFunction():  # the copies to the host are the wire's, not ops of a placement scope
        pickler.dump(message)
    envelope = _ENVELOPE.pack(_KIND_OF[type(message)], call_id, len(pickler.tensors))
    return [envelope, out.getbuffer(), *pickler.tensors, *buffers]


def envelope(frame: Any) -> Tuple[int, int, int]:
    """(kind, call id, number of tensor frames) of a message's first frame."""
    return _ENVELOPE.unpack(bytes(getattr(frame, "buffer", frame)))


def decode(frames: Sequence[Any]) -> Any:
    """The message of `frames` (without the envelope's routing frames): tensors over the frames' memory."""
    _, _, n_tensors = envelope(frames[0])
    body = getattr(frames[1], "buffer", frames[1])
    tensor_frames = frames[2:2 + n_tensors]
    buffers = [getattr(f, "buffer", f) for f in frames[2 + n_tensors:]]
    with torch._C.DisableTorchFunction():
        return _TensorUnpickler(io.BytesIO(body), tensor_frames, buffers).load()


def failure_of(error: BaseException, remote_traceback: str) -> Failure:
    """The `Failure` to send for `error`: the exception itself when it survives pickling."""
    try:
        pickle.loads(pickle.dumps(error))
        kept: Optional[BaseException] = error
    except Exception:
        kept = None
    return Failure(kept, type(error).__name__, str(error), remote_traceback)
