"""The frames of one message between tasks: a head (typed envelope, then a pickle), and its tensors as frames.

A message is `[head, *buffer frames]`. The head is a fixed envelope (which kind of message it is:
`Call`, `Reply`, `Failure`, and the call's id) followed by the pickle (protocol 5) in the same frame
(one frame fewer to send and receive per message); the pickle holds a call as the tuple (function, args,
kwargs) and a reply as its bare value; every dense tensor in it pickles as its dtype and shape with
its memory as an out-of-band buffer, a frame of its own: sent as it is (ZeroMQ sends frames of
more than 64 KB without a copy) and received as a tensor over the frame's buffer (no copy
either). Other out-of-band buffers (numpy arrays) travel the same way. Tensors on a GPU are copied to the host
first; they arrive on the host. A call or reply of plain values (numbers, strings, plain CPU tensors: a ps
step) has a fixed layout after its envelope instead of a pickle (`wire_flat`).
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import pickle
import struct
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from towerflow.cluster.calls import wire_flat
from towerflow.errors import RemoteError

CALL, REPLY, FAILURE = 1, 2, 3  # the envelope's kind: a pickled message
FLAT_CALL, FLAT_REPLY = 4, 5  # a call or reply of plain values, laid out by `wire_flat`
ANSWERS_LATER = "_towerflow_deferred"  # set on a call target by `deferred`
ANSWERS_AT_ONCE = "_towerflow_quick"  # set on a call target by `quick`


def deferred(fn):
    """Mark a call target that returns a torch Future: the reply goes out when it completes, and it runs on
    the serving task's socket thread, so it must not block (it returns at once and completes later)."""
    setattr(fn, ANSWERS_LATER, True)
    return fn


def names_a_function(cls):
    """Mark a class whose instances stand for a function (immutable, hashable, pickled as a reference to it): a
    call through one whose arguments are plain values is laid out without pickle (`wire_flat`)."""
    return wire_flat.keep_references_of(cls)


def quick(fn):
    """Mark a call target that never waits and returns in well under a millisecond's work per call: it runs
    on the serving task's socket thread instead of a pool thread, saving two thread hand-offs per call
    (a third of a small call's cost). It must not call another task or wait on anything."""
    setattr(fn, ANSWERS_AT_ONCE, True)
    return fn

_ENVELOPE = struct.Struct("<BQ")  # kind, call id: the head frame's first bytes, the pickle after them


class Call(NamedTuple):
    """A request: run `fn(*args, **kwargs)` on the receiving task."""

    fn: Any
    args: tuple = ()
    kwargs: Optional[dict] = None


class Reply(NamedTuple):
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

_DTYPES, _CODE_OF = wire_flat.DTYPES, wire_flat.CODE_OF  # a dtype travels as its index, not a global by name
_NUMPY_DTYPES = frozenset(_DTYPES) - {torch.bfloat16}


def _rebuild(data: Any, dtype: torch.dtype, shape: tuple, requires_grad: bool, is_parameter: bool) -> torch.Tensor:
    """A received tensor over its frame's memory (or an empty one), with its autograd flag and Parameter type."""
    if len(data) == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        tensor = torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _reduce_tensor(obj: torch.Tensor):
    """A dense tensor pickles as its shape and dtype, its memory as an out-of-band buffer (its own frame)."""
    if type(obj) is torch.Tensor:  # the common case first, in as few calls as it takes
        try:
            array = obj.numpy()  # refuses a tensor on a GPU, one that requires grad, or one of a dtype numpy lacks
        except (RuntimeError, TypeError):
            array = None
        if array is not None and array.size and array.flags.c_contiguous:
            return (wire_flat.tensor_over, (pickle.PickleBuffer(array), _CODE_OF[obj.dtype], array.shape))
    if obj.layout != torch.strided:
        return obj.__reduce_ex__(5)  # a sparse tensor: its index and value tensors come back here
    tensor = obj.detach() if obj.requires_grad else obj
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    dtype = tensor.dtype
    if tensor.numel() == 0:
        data: Any = b""
    elif dtype in _NUMPY_DTYPES:
        data = pickle.PickleBuffer(tensor.numpy())
    else:  # bfloat16 and the like have no numpy dtype: their bytes
        data = pickle.PickleBuffer(tensor.reshape(-1).view(torch.uint8).numpy())
    code = _CODE_OF.get(dtype)
    if code is not None and type(obj) is torch.Tensor and not obj.requires_grad:
        return (wire_flat.tensor_over, (data, code, tuple(obj.shape)))
    return (_rebuild, (data, dtype, tuple(obj.shape), obj.requires_grad, isinstance(obj, torch.nn.Parameter)))


_REDUCERS = {torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor}
_DISPATCH = {**copyreg.dispatch_table, **_REDUCERS}  # by exact type, in C: the rest at full speed
_mode_on = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: True)


def _pickler() -> Tuple[io.BytesIO, List[Any], pickle.Pickler]:
    out, buffers = io.BytesIO(), []
    pickler = pickle.Pickler(out, protocol=5, buffer_callback=buffers.append)
    pickler.dispatch_table = _DISPATCH
    return out, buffers, pickler


_spare: List[Tuple[io.BytesIO, List[Any], pickle.Pickler]] = []  # picklers not in use (list.pop/append are atomic)


def _dumps(envelope: bytes, body: Any) -> Tuple[bytes, List[Any]]:
    """`envelope` followed by `body` pickled (protocol 5), and its out-of-band buffers. Picklers are reused, message after message (making
    one costs as much as pickling a small call); each call takes one nobody else uses, a new one if none is spare."""
    try:
        out, buffers, pickler = _spare.pop()
    except IndexError:
        out, buffers, pickler = _pickler()
    try:
        out.write(envelope)
        pickler.dump(body)
        return out.getvalue(), [b.raw() for b in buffers]
    finally:
        out.seek(0)
        out.truncate()
        buffers.clear()
        pickler.clear_memo()
        _spare.append((out, buffers, pickler))


def encode(call_id: int, message: Any) -> List[Any]:
    """The frames of `message` (a `Call`, `Reply` or `Failure`): the head, then one frame per tensor (and per
    out-of-band buffer of pickle protocol 5, a numpy array's for example). Plain values are laid out
    (`wire_flat`); anything else pickles, a call and a reply as a plain tuple and value (the envelope says
    which): no class to look up on the other side."""
    kind = _KIND_OF[type(message)]
    mode_on = _mode_on()
    if kind == CALL and not message.kwargs and not mode_on:
        frames = wire_flat.call_frames(_ENVELOPE.pack(FLAT_CALL, call_id), message.fn, message.args)
        if frames is not None:
            return frames
    elif kind == REPLY and not mode_on:
        frames = wire_flat.reply_frames(_ENVELOPE.pack(FLAT_REPLY, call_id), message.value)
        if frames is not None:
            return frames
    body = tuple(message) if kind == CALL else message.value if kind == REPLY else message
    head = _ENVELOPE.pack(kind, call_id)
    if mode_on:  # the copies to the host are the wire's, not ops of a placement scope
        with torch._C.DisableTorchFunction():
            data, buffers = _dumps(head, body)
    else:
        data, buffers = _dumps(head, body)
    return wire_flat.aligned(data, buffers)


def envelope(frame: Any) -> Tuple[int, int]:
    """(kind, call id) of a message's first frame."""
    return _ENVELOPE.unpack_from(getattr(frame, "buffer", frame))


def decode(frames: Sequence[Any]) -> Any:
    """The message of `frames` (without the envelope's routing frames): tensors over the frames' memory."""
    head = memoryview(getattr(frames[0], "buffer", frames[0]))
    kind = _ENVELOPE.unpack_from(head)[0]
    buffers = [getattr(f, "buffer", f) for f in frames[1:]]
    if _mode_on():  # tensors are made over the frames here, not by a placement scope's rules
        with torch._C.DisableTorchFunction():
            return _message(kind, head, buffers)
    return _message(kind, head, buffers)


def _message(kind: int, head: memoryview, buffers: List[Any]) -> Any:
    if kind == FLAT_CALL:
        return Call(*wire_flat.read_call(head, _ENVELOPE.size, buffers))
    if kind == FLAT_REPLY:
        return Reply(wire_flat.read_reply(head, _ENVELOPE.size, buffers))
    value = pickle.loads(head[_ENVELOPE.size:], buffers=buffers)
    if kind == CALL:
        return Call(*value)
    return Reply(value) if kind == REPLY else value


def failure_of(error: BaseException, remote_traceback: str) -> Failure:
    """The `Failure` to send for `error`: the exception itself when it survives pickling."""
    try:
        pickle.loads(pickle.dumps(error))
        kept: Optional[BaseException] = error
    except Exception:
        kept = None
    return Failure(kept, type(error).__name__, str(error), remote_traceback)
