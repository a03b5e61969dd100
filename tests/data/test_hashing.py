"""A string's embedding row is the same in every process, on every host and in every run: the hash is a fixed
function of the value's bytes (64-bit FNV-1a, then splitmix64's finalizer), never Python's salted hash()."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa

from towerflow.data.hashing import hex_ids, stable_hash

WORDS = ["", "a", "apple", "1fbe01fe", "héllo"]
# a change of the hash function moves every string to another row of every trained table: it must be deliberate
FIXED = [8832978290816513101, 99183506424991868, 6721407828216110680, 740963213837771604, 896695031463208415]


def _reference(text: str) -> int:
    """The documented hash, one byte at a time."""
    mask = (1 << 64) - 1
    h = 0xCBF29CE484222325
    for byte in text.encode():
        h = ((h ^ byte) * 0x100000001B3) & mask
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & mask
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & mask
    h ^= h >> 31
    return h >> 1


def test_the_hash_is_the_documented_function_with_fixed_values():
    assert stable_hash(pa.array(WORDS)).tolist() == FIXED == [_reference(w) for w in WORDS]
    assert stable_hash(pa.array(["apple", None])).tolist() == [FIXED[2], FIXED[0]]  # a null hashes as ''
    sliced = pa.array(["x", "apple", "pear"]).slice(1)  # an Arrow slice starts inside the buffers
    assert stable_hash(sliced).tolist() == [FIXED[2], _reference("pear")]
    assert stable_hash(pa.array(WORDS, pa.large_string())).tolist() == FIXED


def test_hex_ids_read_the_digits_and_mark_what_is_not_hex():
    ids, bad = hex_ids(pa.array(["0a", "FF", "", None, "xyz", "f" * 15, "1" * 16]))
    assert ids.tolist() == [10, 255, 0, 0, 0, 16 ** 15 - 1, 0]
    assert bad.tolist() == [False, False, False, False, True, False, True]


_CHILD = """
import os, sys, tempfile
import pyarrow as pa
from towerflow.data import Categorical, FileStream, Schema
from towerflow.data.hashing import stable_hash
print(stable_hash(pa.array(sys.argv[1:])).tolist())
folder = tempfile.mkdtemp()
with open(os.path.join(folder, "t.csv"), "w") as f:
    f.write("y,s\\n" + "".join(f"1,{w}\\n" for w in sys.argv[1:]))
batch = next(iter(FileStream(folder, batch_size=100, schema=Schema("y", (Categorical("s", 1000, "string"),)))))
print(batch["s"].tolist())
"""


def test_the_rows_of_strings_are_the_same_in_processes_of_different_hash_seeds():
    words = ["apple", "pear", "u123", "1fbe01fe", "héllo"]
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, *words], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONHASHSEED": seed}) for seed in ("1", "2")]
    outputs = [child.communicate(timeout=60)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0]
    assert outputs[0] == outputs[1]
    hashes = stable_hash(pa.array(words)).tolist()
    assert outputs[0].splitlines() == [str(hashes), str((np.array(hashes) % 1000).tolist())]
