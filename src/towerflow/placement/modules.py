"""nn.Module side of placement.

A module whose parameters were created under `with device(...)` remembers that device
and runs its forward under it, so a model built layer by layer on different devices
(model parallelism) trains with plain `model(x)` calls. While the placement log is on,
the module running each op is tracked so the log can name it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Optional

import torch
from torch.nn.modules import module as _nn_module

from towerflow.placement import scope as _scope

DEVICE_ATTR = "_towerflow_device"  # the DeviceSpec (or device function) a module's forward runs under


# --- modules built under a scope ---------------------------------------------------------

_registration_handles: List = []


def _on_tensor_registered(module: torch.nn.Module, name: str, tensor):
    frames = _scope.state.frames
    if tensor is None or not frames:
        return None
    frame = frames[-1]
    op = _scope.OpInfo(f"{type(module).__name__}.{name}", "Variable")
    spec = frame.merged_spec(op)
    target = _scope.resolve(spec, op.name)
    if getattr(module, DEVICE_ATTR, None) is None:  # the first registration decides where forward runs
        # A device function keeps deciding per op in forward (variables on one device, ops on another).
        object.__setattr__(module, DEVICE_ATTR, spec if frame.is_static else frame.fn)
        _attach_forward_scope(module)
    if tensor.device != target.torch_device:  # a device function put variables elsewhere than ops
        moved = tensor.detach().to(target.torch_device)
        tensor = torch.nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else moved
        result = tensor
    else:
        result = None
    if target.is_split:
        from towerflow.placement.mode import TAG

        setattr(tensor, TAG, target.index)
        if tensor.requires_grad:  # gradients live where their parameter lives
            tensor.register_post_accumulate_grad_hook(lambda p, i=target.index: setattr(p.grad, TAG, i))
    return result


def _attach_forward_scope(module: torch.nn.Module) -> None:
    module.register_forward_pre_hook(_enter_module_scope)
    module.register_forward_hook(_exit_module_scope, always_call=True)


def _enter_module_scope(module, args):
    from towerflow.placement.mode import sync

    _scope.state.frames.append(_scope.make_frame(getattr(module, DEVICE_ATTR)))
    sync()


def _exit_module_scope(module, args, output):
    from towerflow.placement.mode import sync

    _scope.state.frames.pop()
    sync()


def watch_registrations(enabled: bool) -> None:
    """Global nn hooks are installed only while some scope is active (any thread)."""
    if enabled and not _registration_handles:
        _registration_handles.extend(
            [
                _nn_module.register_module_parameter_registration_hook(_on_tensor_registered),
                _nn_module.register_module_buffer_registration_hook(_on_tensor_registered),
            ]
        )
    elif not enabled and _registration_handles:
        for handle in _registration_handles:
            handle.remove()
        _registration_handles.clear()


# --- which module is running (for the log) ----------------------------------------------


class _ModuleStack(threading.local):
    def __init__(self):
        self.names: List[str] = []
        self.root_names: Optional[Dict[int, str]] = None


_stack = _ModuleStack()
_names_by_root: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[int, str]]" = weakref.WeakKeyDictionary()
_tracking_handles: List = []


def _qualified_name(module: torch.nn.Module) -> str:
    if not _stack.names:  # a root call: learn the names of everything below it
        names = _names_by_root.get(module)
        if names is None:
            names = {id(m): n for n, m in module.named_modules() if n}
            _names_by_root[module] = names
        _stack.root_names = names
        return type(module).__name__
    return (_stack.root_names or {}).get(id(module), type(module).__name__)


def _push_name(module, args):
    _stack.names.append(_qualified_name(module))


def _pop_name(module, args, output):
    if _stack.names:
        _stack.names.pop()


def current_module() -> Optional[str]:
    return _stack.names[-1] if _stack.names else None


def track_modules(enabled: bool) -> None:
    if enabled and not _tracking_handles:
        _tracking_handles.append(_nn_module.register_module_forward_pre_hook(_push_name))
        _tracking_handles.append(_nn_module.register_module_forward_hook(_pop_name, always_call=True))
    elif not enabled and _tracking_handles:
        for handle in _tracking_handles:
            handle.remove()
        _tracking_handles.clear()


def module_device(module: torch.nn.Module):
    """The DeviceSpec (or device function) a module was built under, or None."""
    return getattr(module, DEVICE_ATTR, None)
