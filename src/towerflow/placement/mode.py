"""The TorchFunctionMode that does placement: it puts factories on the scoped device, moves
inputs that live elsewhere, falls back to the CPU for missing kernels, and feeds the log.

It is on PyTorch's mode stack only while a scope is active or the log is on, so code
outside scopes pays nothing.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch._C import _len_torch_function_stack
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode
from torch.utils._device import _device_constructors

from towerflow import config as _config
from towerflow.devices import logical as _logical
from towerflow.errors import PlacementError
from towerflow.placement import log as _log
from towerflow.placement import modules as _modules
from towerflow.placement import scope as _scope

TAG = "_towerflow_logical_index"  # set on tensors that live on one of several logical devices of a physical one

# How each torch function is treated; filled lazily by _kind().
FACTORY, PASSTHROUGH, INPLACE, COMPUTE = range(4)
_PASSTHROUGH_NAMES = frozenset(
    """__get__ __set__ __delete__ __repr__ __str__ __format__ __len__ __iter__ __bool__ __index__ __int__
    __float__ __complex__ __hash__ __array__ __reduce_ex__ __deepcopy__ __setstate__ __contains__
    size dim numel stride is_contiguous data_ptr element_size nelement storage_offset type requires_grad_
    retain_grad register_hook register_post_accumulate_grad_hook backward tolist item numpy to cpu cuda
    copy_ detach detach_ untyped_storage share_memory_ pin_memory record_stream is_pinned get_device
    is_floating_point is_complex dim_order""".split()
)
_CONST_NAMES = frozenset(("tensor", "as_tensor", "asarray", "scalar_tensor"))
_TYPE_NAMES = {"matmul": "MatMul", "mm": "MatMul", "bmm": "BatchMatMul", "addmm": "AddMatMul"}
_MISSING_KERNEL = re.compile(r"not implemented for|Could not run|no kernel|not supported (on|for)|unsupported device")
_WRONG_DEVICE = re.compile(r"same device|on different devices|to be on the same")
_kinds: Dict[Callable, Tuple[int, str, str]] = {}
_kind_of: Dict[Callable, int] = {}  # the treatment alone, for the hot path
_Tensor = torch.Tensor


def _kind(func: Callable) -> Tuple[int, str, str]:
    """(treatment, base name, TF-style type) of a torch function, computed once per function."""
    found = _kinds.get(func)
    if found is not None:
        return found
    name = getattr(func, "__name__", None) or str(func)
    if name.startswith("__") and name.endswith("__"):
        base = name[2:-2]
        base = base[1:] if base.startswith(("r", "i")) and base[1:] in _DUNDER_OPS else base
    else:
        base = name
    if func in _device_constructors():
        kind = FACTORY
    elif name in _PASSTHROUGH_NAMES:
        kind = PASSTHROUGH
    elif name == "__setitem__" or (name.endswith("_") and not name.startswith("__")) or (
        name.startswith("__i") and name[3:-2] in _DUNDER_OPS
    ):
        kind = INPLACE
    else:
        kind = COMPUTE
    if base in _CONST_NAMES:
        op_type = base_name = "Const"
    else:
        base = base.rstrip("_") or base
        op_type = _TYPE_NAMES.get(base) or "".join(p[:1].upper() + p[1:] for p in base.split("_") if p)
        base_name = base
    found = _kinds[func] = (kind, base_name, op_type)
    _kind_of[func] = kind
    return found


_DUNDER_OPS = frozenset(
    "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift div".split()
)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _logical_index(t: torch.Tensor) -> int:
    index = getattr(t, TAG, None)
    if index is None:
        found = _logical.table().for_torch_device(t.device)
        index = found.index if found is not None else 0
    return index


def _tag(out: Any, index: int) -> None:
    if isinstance(out, torch.Tensor):
        setattr(out, TAG, index)
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                setattr(o, TAG, index)


def _inherit_tag(args: tuple, out: Any) -> None:
    for a in args:
        if isinstance(a, torch.Tensor):
            index = getattr(a, TAG, None)
            if index is not None:
                _tag(out, index)
            return


def _device_name(t: torch.Tensor) -> str:
    """Full TF name of the logical device `t` is on (memoised per table: this runs per logged input)."""
    table = _logical.table()
    key = (t.device, getattr(t, TAG, None))
    name = table.name_cache.get(key)
    if name is None:
        device, index = key
        if index is not None:
            found = table.lookup("GPU" if device.type == "cuda" else device.type.upper(), index)
        else:
            found = table.for_torch_device(device)
        name = table.name_cache[key] = found.name if found is not None else str(device)
    return name


def _first_tensor(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    return None


def _move(t: torch.Tensor, target: _scope.Target) -> torch.Tensor:
    """`t` on the target device, copied across physical devices or relabelled across logical ones."""
    if t.device != target.torch_device:
        _log.recorder.count_move(t.device, target.torch_device, _nbytes(t))
        t = t.to(target.torch_device)
        if target.is_split:
            setattr(t, TAG, target.index)
    elif target.is_split and _logical_index(t) != target.index:
        _log.recorder.count_move(t.device, target.torch_device, _nbytes(t))
        t = t.view_as(t)  # same memory: logical devices of one physical device share it
        setattr(t, TAG, target.index)
    return t


def _migrate(args: tuple, kwargs: dict, target: _scope.Target) -> Tuple[tuple, dict, int]:
    """Move every tensor argument (top level and inside lists) that is not on `target`."""
    moved = 0
    dev = target.torch_device
    split = target.is_split
    new_args = None
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if a.device != dev or split:
                b = _move(a, target)
                if b is not a:
                    moved += _nbytes(a)
                    new_args = new_args or list(args)
                    new_args[i] = b
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            items = [_move(x, target) if isinstance(x, torch.Tensor) else x for x in a]
            changed = [x for x, y in zip(a, items) if x is not y]
            if changed:
                moved += sum(_nbytes(x) for x in changed)
                new_args = new_args or list(args)
                new_args[i] = type(a)(items) if isinstance(a, tuple) else items
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor) and k != "out" and (v.device != dev or split):
                b = _move(v, target)
                if b is not v:
                    moved += _nbytes(v)
                    kwargs = {**kwargs, k: b}
    return (tuple(new_args) if new_args is not None else args), kwargs, moved


def _input_devices(args: tuple, kwargs: dict) -> Tuple[str, ...]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            found.append(_device_name(a))
        elif isinstance(a, (list, tuple)):
            found.extend(_device_name(x) for x in a if isinstance(x, torch.Tensor))
    return tuple(dict.fromkeys(found))


def _cpu_target() -> _scope.Target:
    return _scope.Target(_logical.table().lookup("CPU", 0))


class PlacementMode(TorchFunctionMode):
    """One per thread; see the module docstring."""

    def __init__(self):
        super().__init__()
        self._frames = _scope.state.frames  # this thread's scope stack (the mode is per thread too)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = _kind_of.get(func)
        if kind is None:
            kind = _kind(func)[0]
        frames = self._frames
        if frames and kind == COMPUTE and args:
            frame = frames[-1]
            dev = frame.fast_device  # set for a resolved static frame on an unsplit device, log off
            if dev is not None:
                # The hot path: the first input is already on the device. PyTorch itself refuses
                # inputs on other devices (CPU scalars aside), and then the full path moves them.
                a = args[0]
                if isinstance(a, _Tensor) and (a.is_cpu if frame.fast_is_cpu else a.device == dev):
                    try:
                        return func(*args, **kwargs) if kwargs else func(*args)
                    except (RuntimeError, NotImplementedError) as e:
                        if not _WRONG_DEVICE.search(str(e)):
                            return self._fall_back(e, func, args, kwargs or {}, frame._target, _kinds[func][1])[0]
        if kind == PASSTHROUGH:
            return func(*args, **(kwargs or {}))
        return self._slow(func, kind, frames[-1] if frames else _scope._default_frame, args, kwargs or {})

    def _slow(self, func, kind, frame, args, kwargs):
        if _logical.building():  # the device table's own torch calls, made while it is being made
            return func(*args, **kwargs)
        _, base, op_type = _kinds[func]
        if frame is None:  # no scope, only the log: run where the inputs are
            return self._observe(func, args, kwargs, base, op_type)
        target = frame.target(_scope.OpInfo(base, op_type))
        return self._place(func, kind, base, op_type, args, kwargs, target)

    def _place(self, func, kind, base, op_type, args, kwargs, target):
        moved = 0
        generator = kwargs.get("generator")
        if (isinstance(generator, torch.Generator) and target is not None
                and generator.device.type != target.torch_device.type):
            local = _logical.table().for_torch_device(generator.device)  # a generator pins its op, as a device= does
            if local is None:
                return func(*args, **kwargs)
            target = _scope.Target(local, f"its generator is on {generator.device}", target.device.short_name)
        original = (args, kwargs)  # a CPU fallback starts from these, not from copies already made
        if kind == FACTORY:
            if kwargs.get("device") is None:
                kwargs = {**kwargs, "device": target.torch_device}
            else:
                target = None  # an explicit device wins over the scope
        elif kind == INPLACE or "out" in kwargs:
            mutated = kwargs["out"] if "out" in kwargs else _first_tensor((*args, *kwargs.values()))
            if isinstance(mutated, torch.Tensor) and mutated.device != target.torch_device:
                local = _logical.table().for_torch_device(mutated.device)
                target = _scope.Target(local) if local is not None else None
            if target is not None:
                args, kwargs, moved = _migrate(args, kwargs, target)
        else:
            args, kwargs, moved = _migrate(args, kwargs, target)
        fallback = None
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            out, fallback = self._fall_back(e, func, *original, target, base)
        if target is not None and target.is_split and fallback is None:
            _tag(out, target.index)
        if _state.logging:
            t = _first_tensor(out)
            if t is not None:
                requested = target.requested if target is not None else None
                reason = fallback or (target.fallback if target is not None else None)
                if fallback:
                    requested = target.device.short_name
                self._record(base, op_type, _device_name(t), args, kwargs, moved, reason, requested)
        return out

    def _observe(self, func, args, kwargs, base, op_type):
        out = func(*args, **kwargs)
        if _logical.table().has_split:  # outputs stay on their inputs' logical device
            _inherit_tag(args, out)
        if _state.logging:
            t = _first_tensor(out)
            if t is not None:
                self._record(base, op_type, _device_name(t), args, kwargs, 0, None, None)
        return out

    @staticmethod
    def _fall_back(error, func, args, kwargs, target, base):
        """Re-run on the CPU when the device has no kernel (soft placement), else explain."""
        missing = isinstance(error, NotImplementedError) or _MISSING_KERNEL.search(str(error))
        if target is None or target.torch_device.type == "cpu" or not missing:
            raise error
        wanted = target.device.short_name
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if not _config.current().allow_soft_placement:
            raise PlacementError(
                f"op {base!r} has no kernel on {wanted} for these inputs ({first_line}). Run it on another "
                "device, or let towerflow fall back to the CPU with towerflow.configure(allow_soft_placement=True).",
                op=base,
                requested=wanted,
                available=_logical.table().names(),
            ) from error
        cpu = _cpu_target()
        if "device" in kwargs:
            kwargs = {**kwargs, "device": cpu.torch_device}
        args, kwargs, _ = _migrate(args, kwargs, cpu)
        return func(*args, **kwargs), f"no kernel on {wanted}: {first_line}"

    @staticmethod
    def _record(base, op_type, device, args, kwargs, moved, fallback, requested):
        filt = _state.filter
        module = _modules.current_module()
        if filt and not (
            ("op" not in filt or filt["op"].search(base) or filt["op"].search(op_type))
            and ("device" not in filt or filt["device"].search(device))
            and ("module" not in filt or (module and filt["module"].search(module)))
        ):
            _log.recorder.count_op(device, fallback is not None)  # the summary still sees every op
            return
        record = _log.PlacementRecord(
            _log.recorder.unique_name(base),
            op_type,
            device,
            _input_devices(args, kwargs),
            moved,
            fallback,
            module,
            requested,
        )
        _log.recorder.add(record, emit_line=_state.lines)


class _State:
    """Process-wide logging switches, read on every op while the mode is installed."""

    logging = False  # records and totals
    lines = False  # a log line per op
    filter: Optional[dict] = None


_state = _State()


class _ThreadMode(threading.local):
    def __init__(self):
        self.mode = PlacementMode()
        self.installed = False


_thread = _ThreadMode()


def _wanted() -> bool:
    return bool(_scope.state.frames) or _scope._default_frame is not None or _state.logging


def sync() -> None:
    """Put the mode on this thread's stack or take it off, whichever the current state calls for."""
    wanted = _wanted()
    if wanted and not _thread.installed:
        _push_mode(_thread.mode)
        _thread.installed = True
    elif not wanted and _thread.installed:
        _remove(_thread.mode)
        _thread.installed = False


def _remove(mode: PlacementMode) -> None:
    above = []
    while _len_torch_function_stack() > 0:
        top = _pop_mode()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        _push_mode(m)


def _apply(old: _config.Config, new: _config.Config) -> None:
    _state.logging = bool(new.log_device_placement)
    _state.lines = new.log_device_placement is True
    _state.filter = new.log_filter
    _modules.track_modules(_state.logging)
    if new.log_device_placement and not old.log_device_placement:
        _log._ensure_visible()
        if _state.lines:
            _log.logger.info(_logical.device_mapping())
    sync()


_config.on_change(apply=_apply)
