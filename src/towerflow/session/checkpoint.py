"""Checkpoints that lose nothing: parameters, optimizer state, global step, RNG states and the
data position, written atomically with a manifest that proves the payload complete.

A checkpoint counts only when its manifest exists and the payload's size and SHA-256 match it,
so a save killed half-way leaves the previous checkpoint the newest usable one.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import random
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from towerflow import _files
from towerflow._io import atomic_write
from towerflow.errors import CheckpointError, CheckpointMismatchError

log = logging.getLogger("towerflow.checkpoint")
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    manifest: Dict[str, Any]


@dataclasses.dataclass
class RestoredState:
    """What a restore hands back besides the tensors it loaded in place."""

    step: int
    path: str
    data_state: Any
    extra: Any


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _module(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DDP and strategy wrappers keep the user's module here


def _rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _describe(state_dict: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, Any]]:
    return {
        name: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
        for name, t in state_dict.items()
        if isinstance(t, torch.Tensor)
    }


class CheckpointManager:
    """Saves to and restores from one directory, keeping the newest `keep` checkpoints."""

    def __init__(self, directory: str, keep: int = 5):
        if keep < 1:
            raise CheckpointError(f"keep={keep!r}: expected at least 1 checkpoint to keep")
        self.directory = directory
        self.keep = keep

    def save(self, step: int, model: torch.nn.Module, optimizer: Any = None, data_state: Any = None,
             extra: Any = None) -> str:
        """Write checkpoint `step`; returns its path. Older ones beyond `keep` are removed."""
        os.makedirs(self.directory, exist_ok=True)
        model_state = _module(model).state_dict()
        payload = {
            "format": FORMAT,
            "step": int(step),
            "model": model_state,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "rng": _rng_state(),
            "data": data_state,
            "extra": extra,
        }
        path = os.path.join(self.directory, _files.checkpoint_file(step))
        with atomic_write(path) as f:
            torch.save(payload, f)
        manifest = {
            "format": FORMAT,
            "step": int(step),
            "time": time.time(),
            "file": os.path.basename(path),
            "bytes": os.path.getsize(path),
            "sha256": _sha256(path),
            "tensors": _describe(model_state),
        }
        with atomic_write(os.path.join(self.directory, _files.manifest_file(step)), "w") as f:
            json.dump(manifest, f, indent=1)
        self._prune()
        return path

    def _manifests(self) -> List[CheckpointInfo]:
        found = []
        for manifest_path in glob.glob(os.path.join(self.directory, _files.CHECKPOINT_GLOB)):
            try:
                with open(manifest_path) as f:
                    manifest = json.load(f)
                step = int(manifest["step"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("skipping checkpoint manifest %s: unreadable (%s)", manifest_path, e)
                continue
            found.append(CheckpointInfo(step, os.path.join(self.directory, manifest.get("file", "")), manifest))
        return sorted(found, key=lambda c: c.step)

    def checkpoints(self) -> List[CheckpointInfo]:
        """Every checkpoint with a manifest, oldest first (validity is checked on restore)."""
        return self._manifests()

    def problem(self, info: CheckpointInfo) -> Optional[str]:
        """Why `info` cannot be used (payload missing, size or checksum off), or None when it is intact."""
        return self._problem(info)

    def _problem(self, info: CheckpointInfo) -> Optional[str]:
        if not os.path.exists(info.path):
            return "its payload file is missing"
        size = os.path.getsize(info.path)
        if size != info.manifest.get("bytes"):
            return f"payload is {size} bytes, the manifest says {info.manifest.get('bytes')}"
        if _sha256(info.path) != info.manifest.get("sha256"):
            return "payload checksum does not match the manifest (corrupt)"
        return None

    def latest(self) -> Optional[CheckpointInfo]:
        """The newest checkpoint that is complete and intact; broken newer ones are skipped with a warning."""
        for info in reversed(self._manifests()):
            problem = self._problem(info)
            if problem is None:
                return info
            log.warning("skipping checkpoint %s (step %d): %s; trying the previous one", info.path, info.step, problem)
        return None

    def load(self, checkpoint: Optional[CheckpointInfo] = None) -> Optional[tuple]:
        """(info, payload) of the newest usable checkpoint (or `checkpoint`), loaded on the CPU; None when there is none."""
        info = checkpoint or self.latest()
        if info is None:
            return None
        return info, torch.load(info.path, map_location="cpu", weights_only=False)

    def restore(self, model: torch.nn.Module, optimizer: Any = None, checkpoint: Optional[CheckpointInfo] = None,
                restore_rng: bool = True) -> Optional[RestoredState]:
        """Load the newest usable checkpoint into `model` (and `optimizer`); None when there is none."""
        info = checkpoint or self.latest()
        if info is None:
            return None
        module = _module(model)
        self._check_fits(info, module)
        payload = self.load(info)[1]
        module.load_state_dict(payload["model"])
        if optimizer is not None and payload.get("optimizer") is not None:
            optimizer.load_state_dict(payload["optimizer"])
        if restore_rng and payload.get("rng"):
            _set_rng_state(payload["rng"])
        return RestoredState(payload["step"], info.path, payload.get("data"), payload.get("extra"))

    @staticmethod
    def _check_fits(info: CheckpointInfo, module: torch.nn.Module) -> None:
        saved = info.manifest.get("tensors", {})
        current = _describe(module.state_dict())
        missing = sorted(set(current) - set(saved))
        unexpected = sorted(set(saved) - set(current))
        mismatched = sorted(
            f"{name}: checkpoint {saved[name]['dtype']}{saved[name]['shape']} vs model {current[name]['dtype']}{current[name]['shape']}"
            for name in set(saved) & set(current)
            if saved[name] != current[name]
        )
        if missing or unexpected or mismatched:
            parts = []
            if missing:
                parts.append(f"missing from the checkpoint: {', '.join(missing[:10])}")
            if unexpected:
                parts.append(f"not in the model: {', '.join(unexpected[:10])}")
            if mismatched:
                parts.append(f"different shape or dtype: {'; '.join(mismatched[:10])}")
            raise CheckpointMismatchError(
                f"checkpoint {info.path} (step {info.step}) was written by a different model — "
                + " | ".join(parts)
                + ". Point the session at a fresh directory or restore the model this checkpoint belongs to.",
                missing,
                unexpected,
                mismatched,
            )

    def _prune(self) -> None:
        for info in self._manifests()[: -self.keep]:
            # The manifest goes first: a checkpoint without one is simply not there.
            for path in (os.path.join(self.directory, _files.manifest_file(info.step)), info.path):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
