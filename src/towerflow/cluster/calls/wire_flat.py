"""A fixed layout for the commonest messages: a call whose arguments, or a reply whose value, are plain values.

A parameter-server step is a function, a few numbers and a string, and tensors. Pickle carries it,
but its machinery (a pickler per message, a reduce call per tensor, a module lookup per function)
costs as much as the rest of a small round trip. A message whose values are all None, bools,
ints, floats, strs or plain CPU tensors is laid out here instead: a count, then per value a tag
byte and the number, the text or a tensor's dtype and shape; each tensor's memory is a frame of
its own, as in a pickled message. The function travels as its pickled reference, which each side
keeps: the sender pickles it once per function, the receiver unpickles it once. Nothing nests
here and no class is named: anything else is not laid out (None) and travels as a pickle.
"""

from __future__ import annotations

import pickle
import struct
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# dtypes travel as their index here, not as a global the receiver would look up by name
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
CODE_OF = {d: i for i, d in enumerate(DTYPES)}

_NONE, _FALSE, _TRUE, _INT, _FLOAT, _STR, _TENSOR = range(7)
_ONE, _TUPLE = 0, 1  # a reply's value: one value, or a tuple of them
_U16, _I64, _F64 = struct.Struct("<H"), struct.Struct("<q"), struct.Struct("<d")
_TENSOR_HEAD = struct.Struct("<BB")  # dtype code, number of dimensions (then one int64 each)
_MOST_VALUES = 255
_MOST_FUNCTIONS = 4096  # function references kept by a receiver (a program calls a fixed set)
_BATCH, _ALIGN = 8192, 64  # libzmq's send batch (ZMQ_OUT_BATCH_SIZE's default); the tensor bytes' alignment

_KEPT = {types.FunctionType}  # callables whose pickled reference the sender keeps (see `keep_references_of`)
_references: Dict[Any, bytes] = {}  # function -> its pickled reference (sender)
_functions: Dict[bytes, Any] = {}  # pickled reference -> function (receiver)


def tensor_over(data: Any, code: int, shape: tuple) -> torch.Tensor:
    """A received tensor over its frame's memory (dtype `DTYPES[code]`), or an empty one for an empty frame."""
    if len(data) == 0:
        return torch.empty(shape, dtype=DTYPES[code])
    tensor = torch.frombuffer(data, dtype=DTYPES[code])
    return tensor if len(shape) == 1 else tensor.view(shape)


def keep_references_of(cls: type) -> type:
    """Calls through instances of `cls` (immutable, hashable names of a function, which pickle as a reference to
    it) are laid out here, each instance's pickled form kept as a function's is."""
    _KEPT.add(cls)
    return cls


def call_frames(envelope: bytes, fn: Any, args: Sequence[Any]) -> Optional[List[Any]]:
    """The frames of a call of `fn(*args)`, or None when `fn` is not a plain function or an argument not a plain value."""
    reference = _references.get(fn)
    if reference is None:
        if type(fn) not in _KEPT:  # a bound method, say, is made anew per access: not kept, pickled
            return None
        try:
            reference = pickle.dumps(fn, protocol=5)
        except Exception:
            return None
        if len(reference) > 0xFFFF:
            return None
        _references[fn] = reference
    head = bytearray(envelope)
    head += _U16.pack(len(reference))
    head += reference
    buffers: List[Any] = []
    return aligned(head, buffers) if _put(head, buffers, args) else None


def reply_frames(envelope: bytes, value: Any) -> Optional[List[Any]]:
    """The frames of a reply of `value` (a plain value or a tuple of them), or None when it is not laid out here."""
    head = bytearray(envelope)
    buffers: List[Any] = []
    if type(value) is tuple:
        head.append(_TUPLE)
        ok = _put(head, buffers, value)
    else:
        head.append(_ONE)
        ok = _put(head, buffers, (value,))
    return aligned(head, buffers) if ok else None


def aligned(head: Any, buffers: List[Any]) -> List[Any]:
    """The frames, the head padded so that a large first tensor starts a multiple of 64 bytes into the message.

    libzmq fills its 8 KB send batch with what precedes a large frame and then hands the kernel the rest of
    the frame from the tensor's own memory, starting where the batch ended. At some offsets the kernel's copy
    of those bytes into the socket runs much slower (4 MB round trips 1.6x slower on these AMD EPYC machines
    for a 58-byte head than for a 128-byte one); a multiple of 64 is one of the fast ones. The decoder reads
    by counts, and unpickling stops at the pickle's end, so neither sees the padding.
    """
    if buffers and memoryview(buffers[0]).nbytes >= _BATCH:
        before = len(head) + (2 if len(head) <= 255 else 9) + 9  # ZMTP: the head's frame header and the tensor's
        padding = -before % _ALIGN
        if len(head) <= 255 < len(head) + padding:  # the head's frame header grows to 9 bytes
            padding = -(before + 7) % _ALIGN
        head = head + bytes(padding)
    return [head, *buffers]


def _put(head: bytearray, buffers: List[Any], values: Sequence[Any]) -> bool:
    if len(values) > _MOST_VALUES:
        return False
    head.append(len(values))
    for v in values:
        t = type(v)
        if v is None:
            head.append(_NONE)
        elif t is bool:
            head.append(_TRUE if v else _FALSE)
        elif t is int:
            if not -(1 << 63) <= v < (1 << 63):
                return False
            head.append(_INT)
            head += _I64.pack(v)
        elif t is float:
            head.append(_FLOAT)
            head += _F64.pack(v)
        elif t is str:
            text = v.encode()
            if len(text) > 0xFFFF:
                return False
            head.append(_STR)
            head += _U16.pack(len(text))
            head += text
        elif t is torch.Tensor:
            code = CODE_OF.get(v.dtype)
            try:
                array = v.numpy()  # refuses a tensor on a GPU, one that requires grad, or one of a dtype numpy lacks
            except (RuntimeError, TypeError):
                return False
            if code is None or not array.flags.c_contiguous or array.ndim > 255:
                return False
            head.append(_TENSOR)
            head += _TENSOR_HEAD.pack(code, array.ndim)
            head += struct.pack(f"<{array.ndim}q", *array.shape)
            buffers.append(pickle.PickleBuffer(array).raw() if array.size else b"")
        else:
            return False
    return True


def read_call(head: memoryview, offset: int, buffers: Sequence[Any]) -> Tuple[Any, tuple]:
    """(function, arguments) of a laid-out call whose envelope ends at `offset`."""
    (size,) = _U16.unpack_from(head, offset)
    offset += 2
    reference = bytes(head[offset:offset + size])
    fn = _functions.get(reference)
    if fn is None:
        fn = pickle.loads(reference)
        if len(_functions) < _MOST_FUNCTIONS:
            _functions[reference] = fn
    return fn, _get(head, offset + size, buffers)


def read_reply(head: memoryview, offset: int, buffers: Sequence[Any]) -> Any:
    """The value of a laid-out reply whose envelope ends at `offset`."""
    values = _get(head, offset + 1, buffers)
    return values if head[offset] == _TUPLE else values[0]


def _get(head: memoryview, offset: int, buffers: Sequence[Any]) -> tuple:
    count = head[offset]
    offset += 1
    values: List[Any] = []
    frame = 0
    for _ in range(count):
        tag = head[offset]
        offset += 1
        if tag == _TENSOR:
            code, ndim = _TENSOR_HEAD.unpack_from(head, offset)
            offset += 2
            shape = struct.unpack_from(f"<{ndim}q", head, offset)
            offset += 8 * ndim
            values.append(tensor_over(buffers[frame], code, shape))
            frame += 1
        elif tag == _INT:
            values.append(_I64.unpack_from(head, offset)[0])
            offset += 8
        elif tag == _FLOAT:
            values.append(_F64.unpack_from(head, offset)[0])
            offset += 8
        elif tag == _STR:
            (size,) = _U16.unpack_from(head, offset)
            values.append(str(head[offset + 2:offset + 2 + size], "utf-8"))
            offset += 2 + size
        elif tag == _NONE:
            values.append(None)
        elif tag in (_FALSE, _TRUE):
            values.append(tag == _TRUE)
        else:
            raise ValueError(f"a laid-out message has an unknown tag {tag} at byte {offset - 1}")
    return tuple(values)
