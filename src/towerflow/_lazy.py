"""A package's public names imported on first use (PEP 562), so importing the package stays cheap.

Why: `towerflow launch`, `top`, `report`, `smi` and the ClusterSpec / device-name parsers run in
processes that never train; importing torch costs them about 2 s of CPU each on a small machine.
A package lists `name -> module` and gets `__getattr__` / `__dir__` that import the module when a
name is first asked for (`from towerflow.devices import list_devices` works as before).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Dict, Iterable, List, Tuple


def names_from(module: str, names: Iterable[str]) -> Dict[str, str]:
    """{name: module} for each name: the table's entries for one module."""
    return dict.fromkeys(names, module)


def exports(package: str, table: Dict[str, str], subpackages: Iterable[str] = ()
            ) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose names `table` maps to the modules defining them.

    `subpackages` are imported on first use too, so `import towerflow; towerflow.ps.SparseAdam` works
    whether or not something imported `towerflow.ps` before (Python sets that attribute only then).
    """
    subpackages = frozenset(subpackages)

    def __getattr__(name: str) -> Any:
        if name in subpackages:
            return importlib.import_module(f"{package}.{name}")  # the import sets the attribute
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups find it without coming here
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(sys.modules[package])) | set(table) | subpackages)

    return __getattr__, __dir__
