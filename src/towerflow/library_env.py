"""Settings for libraries that read nothing but their environment.

CUDA takes its visible devices, gloo and TensorPipe their network interface, cuBLAS its
deterministic workspace, and a Python child its hash seed from the environment of the process
that loads them, and from nowhere else: setting one is the only way to configure them. These are
the variables a running task writes; its own identity is resolved once by `taskenv` and never
written back, and the variables of the tasks a launcher starts are written by `launch/`.
"""

from __future__ import annotations

import os
from typing import Optional


def value(name: str) -> Optional[str]:
    """The library setting `name` as this process has it now (None: unset)."""
    return os.environ.get(name)


def assign(name: str, setting: Optional[str]) -> None:
    """Set `name` for the libraries this process loads from now on (None: unset it)."""
    if setting is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = setting


def set_default(name: str, setting: str) -> None:
    """Set `name` unless the user already set it: their choice wins."""
    if name not in os.environ:
        os.environ[name] = setting
