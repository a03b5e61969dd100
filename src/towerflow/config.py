"""Process-wide options: TF's ConfigProto for PyTorch, in towerflow's and TF's spellings.

`configure()` validates everything before changing anything, then tells the layers
that care (devices, memory, placement) through listeners, so this module depends on none of them.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable, Dict, List, Optional

from towerflow.errors import ConfigError, did_you_mean

_DEFAULTS: Dict[str, Any] = {
    "log_device_placement": False,  # True: a line per op; "summary": records and totals, no lines
    "log_filter": None,  # {"op": regex, "module": regex, "device": regex}: which ops get lines and records
    "allow_soft_placement": False,
    "visible_devices": None,  # GPU indices, CUDA_VISIBLE_DEVICES semantics (renumbered from 0)
    "gpu_memory_fraction": None,  # per process, of each visible GPU's total memory
    "allow_growth": True,  # False: reserve the memory up front, as TF does by default
    "memory_limit": None,  # MiB for every GPU, or {gpu_index: MiB}
    "logical_devices": None,  # {"CPU": 4} or {"GPU:0": 2} or {"GPU:0": [2048, 2048]} (MiB each)
    "default_device": None,  # None (PyTorch's own default), "auto" (first GPU, else CPU), or a device
}

# TF ConfigProto / GPUOptions spellings and the field each one sets.
_TF_GPU_OPTIONS = {
    "allow_growth": "allow_growth",
    "per_process_gpu_memory_fraction": "gpu_memory_fraction",
    "visible_device_list": "visible_devices",
}


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r}: expected True or False")
    return value


def _check_log_mode(name: str, value: Any):
    if value in (True, False, "summary"):
        return value
    raise ConfigError(f"{name}={value!r}: expected True (a line per op), 'summary' (totals only) or False")


def _check_log_filter(name: str, value: Any):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"{name}={value!r}: expected a dict like {{'op': 'matmul|add', 'device': 'GPU'}}")
    out = {}
    for key, pattern in value.items():
        if key not in ("op", "module", "device"):
            raise ConfigError(f"{name} key {key!r}: expected 'op', 'module' or 'device'.{did_you_mean(key, ('op', 'module', 'device'))}")
        try:
            out[key] = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ConfigError(f"{name}[{key!r}]={pattern!r} is not a regular expression: {e}") from None
    return out


def _check_visible(name: str, value: Any) -> Optional[List[int]]:
    if value is None:
        return None
    if isinstance(value, str):  # TF's visible_device_list="0,1"
        try:
            value = [int(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ConfigError(f"{name}={value!r}: expected comma-separated GPU indices like '0,1'") from None
    try:
        indices = [int(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r}: expected a list of GPU indices like [0, 1]") from None
    if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
        raise ConfigError(f"{name}={value!r}: indices must be distinct and non-negative")
    return indices


def _check_fraction(name: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"{name}={value!r}: expected a fraction in (0, 1], e.g. 0.4 for 40% of each GPU")
    return float(value)


def _check_memory_limit(name: str, value: Any):
    if value is None:
        return None
    items = value.items() if isinstance(value, dict) else [(None, value)]
    for key, mib in items:
        if key is not None and (not isinstance(key, int) or key < 0):
            raise ConfigError(f"{name} key {key!r}: expected a GPU index (int >= 0)")
        if isinstance(mib, bool) or not isinstance(mib, int) or mib <= 0:
            raise ConfigError(f"{name}={value!r}: expected MiB as a positive int, or {{gpu_index: MiB}}")
    return dict(value) if isinstance(value, dict) else value


def _check_logical(name: str, value: Any):
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"{name}={value!r}: expected a dict like {{'CPU': 4}} or {{'GPU:0': [2048, 2048]}}")
    from towerflow.devices.spec import DeviceSpec  # leaf module, no cycle

    out = {}
    for key, split in value.items():
        spec = DeviceSpec.parse(key)
        if spec.device_type not in ("CPU", "GPU") or spec.job or spec.task is not None:
            raise ConfigError(f"{name} key {key!r}: expected a physical 'CPU' or 'GPU:<n>' to split")
        phys = f"{spec.device_type}:{spec.device_index or 0}"
        if isinstance(split, int) and not isinstance(split, bool) and split >= 1:
            out[phys] = [None] * split
        elif isinstance(split, (list, tuple)) and split and all(
            m is None or (isinstance(m, int) and not isinstance(m, bool) and m > 0) for m in split
        ):
            out[phys] = list(split)
        else:
            raise ConfigError(f"{name}[{key!r}]={split!r}: expected a count >= 1 or a list of MiB per logical device")
    return out


def _check_default_device(name: str, value: Any):
    if value is None or value == "auto":
        return value
    from towerflow.devices.spec import DeviceSpec

    return DeviceSpec.parse(value)


_VALIDATORS: Dict[str, Callable[[str, Any], Any]] = {
    "log_device_placement": _check_log_mode,
    "log_filter": _check_log_filter,
    "allow_soft_placement": _check_bool,
    "visible_devices": _check_visible,
    "gpu_memory_fraction": _check_fraction,
    "allow_growth": _check_bool,
    "memory_limit": _check_memory_limit,
    "logical_devices": _check_logical,
    "default_device": _check_default_device,
}


class _GPUOptionsView:
    """`config.gpu_options.allow_growth = True` as in TF, writing through to the Config."""

    def __init__(self, config: "Config"):
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name: str):
        if name in _TF_GPU_OPTIONS:
            return getattr(self._config, _TF_GPU_OPTIONS[name])
        raise AttributeError(f"gpu_options has no option {name!r}; known: {', '.join(_TF_GPU_OPTIONS)}.{did_you_mean(name, _TF_GPU_OPTIONS)}")

    def __setattr__(self, name: str, value: Any):
        if name not in _TF_GPU_OPTIONS:
            raise ConfigError(f"gpu_options has no option {name!r}; known: {', '.join(_TF_GPU_OPTIONS)}.{did_you_mean(name, _TF_GPU_OPTIONS)}")
        setattr(self._config, _TF_GPU_OPTIONS[name], value)


class Config:
    """All of towerflow's process options; also takes TF's ConfigProto spellings unchanged.

    `Config(log_device_placement=True, allow_soft_placement=True)`,
    `config.gpu_options.allow_growth = True`, `Config(device_count={"CPU": 4})`.
    """

    def __init__(self, **options: Any):
        object.__setattr__(self, "_values", dict(_DEFAULTS))
        self.update(**options)

    def update(self, **options: Any) -> "Config":
        for name, value in options.items():
            if name == "gpu_options":
                self._set_gpu_options(value)
            elif name == "device_count":
                self._set_device_count(value)
            else:
                setattr(self, name, value)
        return self

    def _set_gpu_options(self, value: Any) -> None:
        if isinstance(value, _GPUOptionsView):
            value = {k: getattr(value, k) for k in _TF_GPU_OPTIONS}
        if not isinstance(value, dict):
            raise ConfigError(f"gpu_options={value!r}: expected a dict like {{'allow_growth': True}}")
        for key, v in value.items():
            setattr(self.gpu_options, key, v)

    def _set_device_count(self, value: Any) -> None:
        """TF's `device_count={"CPU": 4, "GPU": 0}`: N logical CPUs; GPU 0 hides every GPU."""
        if not isinstance(value, dict):
            raise ConfigError(f"device_count={value!r}: expected a dict like {{'CPU': 4, 'GPU': 1}}")
        for kind, n in value.items():
            if kind.upper() == "CPU":
                self.logical_devices = {**(self.logical_devices or {}), "CPU:0": n}
            elif kind.upper() == "GPU":
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise ConfigError(f"device_count['GPU']={n!r}: expected an int >= 0")
                self.visible_devices = (self.visible_devices if self.visible_devices is not None else list(range(n)))[:n]
            else:
                raise ConfigError(f"device_count key {kind!r}: expected 'CPU' or 'GPU'")

    @property
    def gpu_options(self) -> _GPUOptionsView:
        return _GPUOptionsView(self)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"Config has no option {name!r}.{did_you_mean(name, _DEFAULTS)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _VALIDATORS:
            known = [*_DEFAULTS, "gpu_options", "device_count"]
            raise ConfigError(
                f"unknown option {name!r}; known options: {', '.join(known)}.{did_you_mean(name, known)}"
            )
        self._values[name] = _VALIDATORS[name](name, value)

    def as_dict(self) -> Dict[str, Any]:
        return copy.deepcopy(self._values)

    def copy(self) -> "Config":
        new = Config()
        object.__setattr__(new, "_values", copy.copy(self._values))
        return new

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._values == other._values

    def __repr__(self) -> str:
        changed = {k: v for k, v in self._values.items() if v != _DEFAULTS[k]}
        return f"Config({', '.join(f'{k}={v!r}' for k, v in changed.items())})"


_current = Config()
_listeners: List[Callable[[Config, Config], None]] = []
_checks: List[Callable[[Config, Config], None]] = []


def current() -> Config:
    """The active configuration (a copy: change it through `configure`)."""
    return _current.copy()


def on_change(check: Optional[Callable[[Config, Config], None]] = None, apply: Optional[Callable[[Config, Config], None]] = None) -> None:
    """Register a layer: `check(old, new)` may refuse a change by raising; `apply(old, new)` enacts it."""
    if check is not None:
        _checks.append(check)
    if apply is not None:
        _listeners.append(apply)


def configure(config: Optional[Config] = None, **options: Any) -> Config:
    """Change process options at run time; unspecified options keep their current values.

    Nothing changes when any option is invalid or can no longer take effect.
    """
    global _current
    if config is not None and not isinstance(config, Config):
        raise ConfigError(f"configure() takes a towerflow.Config, got {type(config).__name__}")
    new = (config.copy() if config is not None else _current.copy()).update(**options)
    old = _current
    for check in _checks:
        check(old, new)
    _current = new
    for apply in _listeners:
        apply(old, new)
    return new.copy()
