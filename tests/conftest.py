"""Shared fixtures: every test starts from default options and must not leak placement state."""

from __future__ import annotations

import pytest
import torch

import towerflow
from towerflow.devices import logical
from towerflow.placement import mode, scope


def _reset() -> None:
    logical._in_use = False
    towerflow.configure(towerflow.Config())
    towerflow.placement_log(clear=True)


@pytest.fixture(autouse=True)
def clean_placement_state():
    _reset()
    yield
    leaked_frames = list(scope.state.frames)
    scope.state.frames.clear()
    _reset()
    assert not leaked_frames, f"a test left device scopes open: {leaked_frames}"
    assert not mode._thread.installed, "the placement mode is still installed with no scope and the log off"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
