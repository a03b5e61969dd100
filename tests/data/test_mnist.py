"""The shared MNIST loader: IDX parsing, the fixed 8000/2000 split, the digits fallback."""

import gzip
import os

import numpy as np
import pytest

from towerflow.data import load_digits_split, load_mnist_or_digits, load_mnist_t10k, read_idx
from towerflow.errors import DataError

REAL = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "mnist-t10k")


def _write_idx(path, array, compress=True):
    codes = {np.uint8: 0x08, np.int32: 0x0C}
    header = bytes([0, 0, codes[array.dtype.type], array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    body = array.astype(array.dtype.newbyteorder(">")).tobytes()
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(header + body)


def _fake_t10k(folder, n=20):
    rng = np.random.default_rng(0)
    _write_idx(folder / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
    _write_idx(folder / "t10k-labels-idx1-ubyte.gz", (np.arange(n) % 10).astype(np.uint8))


def test_read_idx_roundtrips_gzip_and_raw(tmp_path):
    a = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    _write_idx(tmp_path / "a.gz", a)
    _write_idx(tmp_path / "a", a, compress=False)
    assert (read_idx(str(tmp_path / "a.gz")) == a).all()
    assert (read_idx(str(tmp_path / "a")) == a).all()


def test_read_idx_rejects_non_idx_and_truncated(tmp_path):
    (tmp_path / "x").write_bytes(b"hello world")
    with pytest.raises(DataError, match="not an IDX file"):
        read_idx(str(tmp_path / "x"))
    _write_idx(tmp_path / "t", np.zeros((4, 4), np.uint8), compress=False)
    (tmp_path / "t").write_bytes((tmp_path / "t").read_bytes()[:-3])
    with pytest.raises(DataError, match="truncated"):
        read_idx(str(tmp_path / "t"))


def test_split_is_first_n_train_rest_test(tmp_path):
    _fake_t10k(tmp_path, n=20)
    split = load_mnist_t10k(str(tmp_path), n_train=15)
    assert split.train.tensors[0].shape == (15, 1, 28, 28)
    assert split.test.tensors[1].tolist() == [5, 6, 7, 8, 9]
    assert split.name == "mnist-t10k"


def test_missing_folder_or_files_say_what_to_pass(tmp_path):
    with pytest.raises(DataError, match="not a folder"):
        load_mnist_t10k(str(tmp_path / "nope"))
    with pytest.raises(DataError, match="--data"):
        load_mnist_t10k(str(tmp_path))


def test_digits_fallback_without_a_path():
    split = load_mnist_or_digits(None)
    assert split.name == "digits"
    assert len(split.train) + len(split.test) == 1797
    assert split.train.tensors[0].shape[1:] == (1, 8, 8)
    assert len(load_digits_split().test) == 360


def test_digits_read_from_scikit_learns_csv_match_load_digits():
    from sklearn.datasets import load_digits

    from towerflow.data.mnist import _digits

    digits = load_digits()
    images, labels = _digits()
    np.testing.assert_array_equal(images, digits.images)
    np.testing.assert_array_equal(labels, digits.target)


@pytest.mark.skipif(not os.path.isdir(REAL), reason="the shared MNIST-t10k folder is not here")
def test_real_mnist_t10k_split():
    split = load_mnist_t10k(REAL)
    assert (len(split.train), len(split.test)) == (8000, 2000)
    assert abs(float(split.train.tensors[0].mean())) < 0.2  # normalised
