"""TensorFlow device names: the one parser, formatter and merge rule towerflow uses everywhere."""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    import torch

from towerflow.errors import DeviceSpecError, did_you_mean

GRAMMAR = (
    "/job:<name>/replica:<n>/task:<n>/device:<TYPE>:<n>, any part optional, e.g. "
    "'/job:ps/task:0', '/gpu:1', '/device:CPU:0', 'GPU:0', 'cuda:1', 'cpu'"
)

# The device types towerflow knows, and the spellings that mean them (lower-case keys): these are
# case-insensitive and may be written short ('/gpu:0'). Any other type is a plug-in's
# ('/device:MyFunnyDevice:2'): as in TF it parses as written, only in the long form (the short
# form would swallow typos such as '/gpo:0'), and placement decides whether this machine has it.
_TYPE_ALIASES = {
    "cpu": "CPU",
    "gpu": "GPU",
    "cuda": "GPU",
    "mps": "MPS",
    "tpu": "TPU",
    "xla_cpu": "XLA_CPU",
    "xla_gpu": "XLA_GPU",
}
DEVICE_TYPES = tuple(sorted(set(_TYPE_ALIASES.values())))
DEVICE_TYPE_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")  # TF's rule for a device type

JOB_NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*$")
_FIELDS = ("job", "replica", "task", "device_type", "device_index")

DeviceLike = Union[str, "DeviceSpec", "torch.device", None]


def _canonical_type(text: str, whole: str, short_form: bool = False) -> str:
    """A known type's canonical name ('cuda' -> 'GPU'); a plug-in type as written (not in the short form)."""
    canonical = _TYPE_ALIASES.get(text.lower())
    if canonical is not None:
        return canonical
    well_formed = bool(DEVICE_TYPE_PATTERN.match(text))
    if short_form:
        plug_in = f" A plug-in device type is written in full: '/device:{text}:<n>'." if well_formed else ""
        raise DeviceSpecError(
            f"unknown device type {text!r} in {whole!r}; the short form '/<type>:<n>' takes one of "
            f"{', '.join(DEVICE_TYPES)} (or torch's 'cuda').{did_you_mean(text.lower(), _TYPE_ALIASES)}{plug_in} "
            f"Grammar: {GRAMMAR}"
        )
    if not well_formed:
        raise DeviceSpecError(
            f"bad device type {text!r} in {whole!r}: expected a letter followed by letters, digits or '_' "
            f"(e.g. GPU, XLA_CPU, or a plug-in's MY_DEVICE). Grammar: {GRAMMAR}"
        )
    return text


def _index(text: str, what: str, whole: str, allow_star: bool = False) -> Optional[int]:
    if allow_star and text == "*":
        return None
    if not text.isdigit():
        raise DeviceSpecError(
            f"bad {what} {text!r} in {whole!r}: expected a non-negative integer"
            f"{' or *' if allow_star else ''}. Grammar: {GRAMMAR}"
        )
    return int(text)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """A full or partial TF device name; unset fields are None and inherit when merged."""

    job: Optional[str] = None
    replica: Optional[int] = None
    task: Optional[int] = None
    device_type: Optional[str] = None
    device_index: Optional[int] = None

    def __post_init__(self):
        if self.job is not None and not JOB_NAME_PATTERN.match(self.job):
            raise DeviceSpecError(
                f"bad job name {self.job!r}: expected a letter followed by letters, digits, '_' or '-'"
            )
        for name in ("replica", "task", "device_index"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise DeviceSpecError(f"bad {name} {value!r}: expected a non-negative integer or None")
        if self.device_type is not None:
            object.__setattr__(self, "device_type", _canonical_type(str(self.device_type), str(self.device_type)))

    @classmethod
    def from_string(cls, spec: str) -> "DeviceSpec":
        """Parse TF (`/job:ps/task:1/device:GPU:0`, `/gpu:1`) and torch (`cuda:1`, `cpu`) spellings."""
        if not isinstance(spec, str):
            raise DeviceSpecError(f"expected a device string, got {type(spec).__name__} {spec!r}")
        fields: dict = {}

        def put(name: str, value, part: str) -> None:
            if name in fields:
                raise DeviceSpecError(f"{name} given twice in {spec!r} (at {part!r}). Grammar: {GRAMMAR}")
            fields[name] = value

        text = spec.strip()
        for part in [p for p in text.split("/") if p] if text else []:
            key, _, rest = part.partition(":")
            lowered = key.lower()
            if lowered == "job" and rest:
                if not JOB_NAME_PATTERN.match(rest):
                    raise DeviceSpecError(f"bad job name {rest!r} in {spec!r}. Grammar: {GRAMMAR}")
                put("job", rest, part)
            elif lowered in ("replica", "task") and rest:
                put(lowered, _index(rest, lowered, spec), part)
            elif lowered == "device" and rest:
                dtype, _, idx = rest.partition(":")
                if dtype != "*":  # '/device:*:1' (what to_string writes for an index alone): any type
                    put("device_type", _canonical_type(dtype, spec), part)
                if idx:
                    put("device_index", _index(idx, "device index", spec, allow_star=True), part)
            elif lowered in _TYPE_ALIASES or (rest and lowered not in ("job", "replica", "task", "device")):
                put("device_type", _canonical_type(key, spec, short_form=True), part)
                if rest:
                    put("device_index", _index(rest, "device index", spec, allow_star=True), part)
            else:
                raise DeviceSpecError(f"cannot parse {part!r} in {spec!r}. Grammar: {GRAMMAR}")
        return cls(**fields)

    @classmethod
    def parse(cls, device: DeviceLike) -> "DeviceSpec":
        """Accept whatever a user may pass as a device: str, DeviceSpec, torch.device or None."""
        if device is None:
            return cls()
        if isinstance(device, DeviceSpec):
            return device
        torch = sys.modules.get("torch")  # not imported here: the launcher and the CLI parse names without torch
        if torch is not None and isinstance(device, torch.device):
            return cls(device_type=_canonical_type(device.type, str(device)), device_index=device.index)
        return cls.from_string(device)

    def to_string(self) -> str:
        """Canonical TF form: `/job:ps/replica:0/task:1/device:GPU:0`; unset fields are left out."""
        out = []
        if self.job is not None:
            out.append(f"/job:{self.job}")
        if self.replica is not None:
            out.append(f"/replica:{self.replica}")
        if self.task is not None:
            out.append(f"/task:{self.task}")
        if self.device_type is not None:
            index = "*" if self.device_index is None else self.device_index
            out.append(f"/device:{self.device_type}:{index}")
        elif self.device_index is not None:
            out.append(f"/device:*:{self.device_index}")
        return "".join(out)

    def merge(self, other: DeviceLike) -> "DeviceSpec":
        """TF's nesting rule: the fields `other` sets override ours, the rest are inherited."""
        other = DeviceSpec.parse(other)
        return DeviceSpec(**{f: getattr(other, f) if getattr(other, f) is not None else getattr(self, f) for f in _FIELDS})

    def replace(self, **fields) -> "DeviceSpec":
        return dataclasses.replace(self, **fields)

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, f) is None for f in _FIELDS)

    @property
    def device_name(self) -> Optional[str]:
        """Just the device part, `/device:GPU:0`, or None when no type is set."""
        return DeviceSpec(device_type=self.device_type, device_index=self.device_index).to_string() or None

    def __str__(self) -> str:
        return self.to_string()
