"""MNIST from IDX files (gzip or raw), with a fixed train/test split and a digits fallback.

The examples and tests train on MNIST's 10,000-image test set split once and for all
(first 8,000 train / last 2,000 test), so results are comparable between runs and machines.
Without a path, scikit-learn's 8x8 `load_digits` stands in (first 80% train / rest test).
"""

from __future__ import annotations

import gzip
import importlib.util
import os
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import TensorDataset

from towerflow.errors import DataError

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
T10K_IMAGES = "t10k-images-idx3-ubyte"
T10K_LABELS = "t10k-labels-idx1-ubyte"
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class Split(NamedTuple):
    """A fixed train/test split and the name of the data it came from."""

    train: TensorDataset
    test: TensorDataset
    name: str


def read_idx(path: str) -> np.ndarray:
    """The array in one IDX file (`.gz` or raw), as LeCun's format defines it."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read IDX file {path!r}: {e}") from e
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise DataError(f"{path!r} is not an IDX file: its magic number is {data[:4].hex()!r}, expected 0000 08 0N")
    ndim = data[3]
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    offset = 4 + 4 * ndim
    expected = offset + int(np.prod(dims)) * dtype.itemsize
    if len(data) != expected:
        raise DataError(f"{path!r} holds {len(data)} bytes; its header {dims} needs {expected}: the file is truncated")
    return np.frombuffer(data, dtype=dtype, offset=offset).reshape(dims)


def _find(directory: str, stem: str) -> str:
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx")):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    raise DataError(
        f"no {stem}[.gz] in {directory!r} (it holds: {sorted(os.listdir(directory))}). Pass the folder with MNIST's "
        "t10k IDX files as --data, or leave --data out to use scikit-learn's digits."
    )


def load_mnist_t10k(path: str, n_train: int = 8000) -> Split:
    """MNIST-t10k at `path` (a folder) split first `n_train` train / the rest test; normalised [N,1,28,28]."""
    if not os.path.isdir(path):
        raise DataError(f"--data {path!r} is not a folder; expected the folder holding {T10K_IMAGES}.gz")
    images = read_idx(_find(path, T10K_IMAGES))
    labels = read_idx(_find(path, T10K_LABELS))
    if images.ndim != 3 or labels.shape != (images.shape[0],):
        raise DataError(f"images {images.shape} and labels {labels.shape} in {path!r} do not match")
    if not 0 < n_train < len(labels):
        raise DataError(f"n_train={n_train!r}: expected between 1 and {len(labels) - 1}")
    x = torch.from_numpy(images.astype(np.float32) / 255.0).sub_(MNIST_MEAN).div_(MNIST_STD).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    return Split(TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:]), "mnist-t10k")


def _digits() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (images [1797,8,8], labels [1797]), what `sklearn.datasets.load_digits` returns.

    Read from the CSV that ships inside scikit-learn, which `load_digits` parses the same way, without
    importing scikit-learn: that import (scipy and more) costs every task of a demo a second or more.
    """
    spec = importlib.util.find_spec("sklearn")  # a top-level package: found, not imported
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            with gzip.open(path, "rt") as f:
                data = np.loadtxt(f, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    try:  # a scikit-learn that keeps its data elsewhere
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise DataError("the digits fallback needs scikit-learn: pip install 'towerflow[examples]'") from e
    digits = load_digits()
    return digits.images, digits.target


def load_digits_split(train_fraction: float = 0.8) -> Split:
    """scikit-learn's 1,797 8x8 digits, first `train_fraction` train / rest test; normalised [N,1,8,8]."""
    images, labels = _digits()
    x = torch.from_numpy(images.astype(np.float32) / 16.0).sub_(0.5).div_(0.5).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    n = int(len(y) * train_fraction)
    return Split(TensorDataset(x[:n], y[:n]), TensorDataset(x[n:], y[n:]), "digits")


def load_mnist_or_digits(path: Optional[str] = None, n_train: int = 8000) -> Split:
    """MNIST-t10k when `path` is given, else the digits fallback."""
    return load_mnist_t10k(path, n_train) if path else load_digits_split()


def image_shape(split: Split) -> Tuple[int, int, int]:
    return tuple(split.train.tensors[0].shape[1:])
