"""docs/architecture.md is the map of the code: every module is on it, every module it names exists, and it reads
in an editor (no line past 120 characters)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
SRC = ROOT / "src" / "towerflow"


def test_every_module_is_on_the_map():
    modules = [p for p in SRC.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts]
    missing = sorted(str(p.relative_to(SRC)) for p in modules if p.name not in DOC)
    assert not missing, f"modules docs/architecture.md does not name: {missing}"


def test_every_module_the_map_names_exists():
    names = {p.name for p in SRC.rglob("*.py")} | {p.name for p in (ROOT / "tests").rglob("*.py")}
    named = set(re.findall(r"`(?:[\w/]+/)?(\w+\.py)`", DOC))
    gone = sorted(n for n in named if n not in names)
    assert not gone, f"docs/architecture.md names modules that do not exist: {gone}"


def test_the_map_reads_in_an_editor():
    long = [i + 1 for i, line in enumerate(DOC.splitlines()) if len(line) > 120]
    assert not long, f"docs/architecture.md lines over 120 characters: {long[:10]}"
