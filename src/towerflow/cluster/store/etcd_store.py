"""`EtcdStore`: the cluster's rendezvous store kept in etcd, as a `torch.distributed.Store`.

A c10d store that no task hosts: the rendezvous, the membership and the failure records then
outlive any task and any host, the coordinator's included, and one etcd member of three (etcd
keeps serving while a majority is up). Being a `dist.Store` subclass, it goes wherever a TCPStore
goes: `PrefixStore`, gloo's `init_process_group(store=...)`, towerflow's membership code.

Every key of a run lives under one prefix and is attached to one etcd lease that every process
using the store keeps alive: when the last of them is gone, the run's keys expire `LEASE_TTL` s
later, so a new run of the same cluster starts clean instead of finding the last one ended. The few
records that must outlive the run (`remember`: a run's end, which run a launcher's tasks belong to)
sit beside the prefix on a lease of their own, for `OUTLIVE_TTL` s.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist

from towerflow.cluster.store import etcd as _etcd
from towerflow.cluster.store.etcd import compare, put_op, range_kvs, range_op

LEASE_TTL = 20  # seconds a run's keys outlive its last process
OUTLIVE_TTL = 24 * 3600  # seconds a record that outlives its run is kept (`remember`)
POLL_FIRST, POLL_MAX = 0.01, 0.2  # a blocking get polls this often, backing off
TXN_OPS = 128  # etcd's default --max-txn-ops: a batched call of more keys is split into transactions of this many
# Every EtcdStore of this process, for its lifetime: a PrefixStore (C++) over one holds only its C++ half,
# and once the Python object is collected its methods fall back to c10d's "Not implemented".
_OPEN: List["EtcdStore"] = []


def _bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # c10d hands a value as a list of ints


class EtcdStore(dist.Store):
    """A c10d store over etcd at `endpoints`, its keys under `prefix`; `timeout` bounds a blocking get
    or wait (as TCPStore's), `deadline` how long any call looks for a member that answers
    (`reach_within` the first one's, which attaches to the run's lease)."""

    def __init__(self, endpoints: Sequence[Tuple[str, int]], prefix: str, timeout: float, deadline: float = 30.0,
                 reach_within: Optional[float] = None):
        super().__init__()  # the pybind trampoline needs it
        self.set_timeout(datetime.timedelta(seconds=timeout))
        self.client = _etcd.EtcdClient(endpoints, deadline if reach_within is None else reach_within)
        self.prefix = ("/" + prefix.strip("/") + "/").encode()
        self._revisions: dict = {}  # key -> (value, mod_revision) last seen: add() then costs one round trip
        self._outlive_lease: Optional[int] = None  # granted by the first `remember`
        self.lease = self._attach_lease()  # EtcdUnavailable when no member answers within reach_within s
        self.client.deadline = deadline
        self._closed = threading.Event()
        _OPEN.append(self)
        threading.Thread(target=self._keep_alive, name="towerflow-etcd-lease", daemon=True).start()

    def _key(self, key) -> bytes:
        return self.prefix + _bytes(key)

    def _aside(self, name: bytes) -> bytes:
        """A key of the run that is not a key of the store (beside the prefix, not under it)."""
        return self.prefix[:-1] + b"\0" + name

    # --- the run's lease -------------------------------------------------------------------

    def _attach_lease(self) -> int:
        """The run's lease: the one named under the prefix, else a new one this process puts there."""
        record = self._aside(b"lease")
        while True:
            held = self.client.get(record)
            if held is not None and self.client.keepalive(int(held["value"])) > 0:
                return int(held["value"])
            lease = self.client.grant(LEASE_TTL)
            created, _ = self.client.txn([compare(record, "CREATE", 0)], [put_op(record, str(lease).encode(), lease)])
            if created:
                return lease
            self.client.revoke(lease)  # another process made the run's lease first: use that one

    def _keep_alive(self) -> None:
        while not self._closed.wait(LEASE_TTL / 4):
            try:
                self.client.keepalive(self.lease, deadline=LEASE_TTL / 4)
            except Exception:  # no member answers now; the next round tries again, the keys wait LEASE_TTL s
                pass

    def close(self) -> None:
        """Stop renewing the run's lease (the other processes of the run keep it)."""
        self._closed.set()

    # --- records that outlive the run ------------------------------------------------------

    def remember(self, name: str, value: str) -> None:
        """Keep `value` as record `name` for OUTLIVE_TTL s, whatever becomes of the run's lease: what a task
        restarted after its run's keys expired must still learn (cluster/membership/ending.py)."""
        if self._outlive_lease is None:
            self._outlive_lease = self.client.grant(OUTLIVE_TTL)
        self.client.put(self._aside(b"outlive/" + name.encode()), value.encode(), self._outlive_lease)

    def recall(self, name: str) -> Optional[str]:
        """Record `name` (`remember`), or None."""
        held = self.client.get(self._aside(b"outlive/" + name.encode()))
        return None if held is None else _bytes(held["value"]).decode()

    # --- c10d's Store ----------------------------------------------------------------------

    def set(self, key, value) -> None:
        self.client.put(self._key(key), _bytes(value), self.lease)

    def get(self, key) -> bytes:
        return self._wait_for([key], self.timeout)[0]

    def check(self, keys) -> bool:
        keys = list(keys)
        for part in _parts(keys):  # all of them set; a key once set is not unset by the protocol's batched reads
            held, _ = self.client.txn([compare(self._key(k), "VERSION", 0, "GREATER") for k in part], [])
            if not held:
                return False
        return True

    def wait(self, keys, timeout: Optional[datetime.timedelta] = None) -> None:
        self._wait_for(list(keys), self.timeout if timeout is None else timeout)

    def multi_get(self, keys) -> List[bytes]:
        return self._wait_for(list(keys), self.timeout)

    def multi_set(self, keys, values) -> None:
        ops = [put_op(self._key(k), _bytes(v), self.lease) for k, v in zip(keys, values)]
        for part in _parts(ops):  # atomic per TXN_OPS keys
            self.client.txn([], part)

    def add(self, key, value: int) -> int:
        """Add `value` to the counter at `key` (absent: 0) atomically; a counter this process alone writes
        (a heartbeat) costs one round trip, as its last revision is known. The write leaves this call's
        mark beside the counter, so a retry of a write that etcd applied but whose reply was lost (a
        member lost mid-call) finds its mark and does not add twice."""
        k = self._key(key)
        if value == 0:
            held = self.client.get(k)
            return int(held["value"]) if held else 0
        mark, mine = self._aside(b"added/" + _bytes(key)), os.urandom(8).hex().encode()
        seen = self._revisions.get(k)
        while True:
            count, cond = (int(seen[0]), compare(k, "MOD", seen[1])) if seen else (0, compare(k, "CREATE", 0))
            new = str(count + value).encode()
            ok, responses = self.client.txn([cond], [put_op(k, new, self.lease), put_op(mark, mine, self.lease),
                                                     range_op(k)], [range_op(k), range_op(mark)])
            kvs = range_kvs(responses[-1 if ok else 0]) if responses else []
            seen = (kvs[0]["value"], kvs[0]["mod_revision"]) if kvs else None
            if ok:
                if seen is not None:
                    self._revisions[k] = seen
                return count + value
            marks = range_kvs(responses[1]) if len(responses) > 1 else []
            if marks and marks[0]["value"] == mine:  # this call's own write, applied before a retry
                self._revisions.pop(k, None)
                return int(new)

    def compare_set(self, key, expected, desired) -> bytes:
        """TCPStore's rule: set `desired` when the value is `expected` (absent counts as b''), and return
        the value now held; an absent key with a non-empty `expected` is left absent and `expected` returned."""
        k, expected, desired = self._key(key), _bytes(expected), _bytes(desired)
        held = compare(k, "CREATE", 0) if expected == b"" else compare(k, "VALUE", expected)
        ok, responses = self.client.txn([held], [put_op(k, desired, self.lease)], [range_op(k)])
        if ok:
            return desired
        kvs = range_kvs(responses[0]) if responses else []
        if not kvs:
            return expected
        if kvs[0]["value"] == expected:  # b'' held as a value: compare it as one
            return self._set_if(k, expected, desired)
        return kvs[0]["value"]

    def _set_if(self, k: bytes, expected: bytes, desired: bytes) -> bytes:
        ok, responses = self.client.txn([compare(k, "VALUE", expected)], [put_op(k, desired, self.lease)], [range_op(k)])
        if ok:
            return desired
        kvs = range_kvs(responses[0]) if responses else []
        return kvs[0]["value"] if kvs else expected

    def delete_key(self, key) -> bool:
        return self.client.delete(self._key(key)) > 0

    def num_keys(self) -> int:
        reply = self.client.range(self.prefix, _etcd.prefix_end(self.prefix), count_only=True)
        return int(reply.get("count", 0))

    # the names c10d's C++ calls (through a PrefixStore) for these two
    deleteKey = delete_key
    getNumKeys = num_keys

    # --- waiting ---------------------------------------------------------------------------

    def _wait_for(self, keys: List, timeout: datetime.timedelta) -> List[bytes]:
        """The values of `keys` once all are set (one transaction per poll); DistStoreError past `timeout`."""
        full = [self._key(k) for k in keys]
        deadline = time.monotonic() + timeout.total_seconds()
        pause = POLL_FIRST
        while True:
            values = [range_kvs(r) for part in _parts(full) for r in self.client.txn([], [range_op(k) for k in part])[1]]
            if all(values):
                return [v[0]["value"] for v in values]
            if time.monotonic() >= deadline:
                missing = [_bytes(k).decode(errors="replace") for k, v in zip(keys, values) if not v]
                raise dist.DistStoreError(f"wait timeout after {timeout.total_seconds():g} s for keys {missing} in "
                                          f"etcd at {self.client.describe()} (prefix {self.prefix.decode()})")
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(POLL_MAX, pause * 2)


def _parts(items: List) -> List[List]:
    """`items` in runs of at most TXN_OPS: etcd refuses a transaction of more operations ("too many operations in
    txn request"), and a check or read of every task's keys names 2N of them."""
    return [items[i:i + TXN_OPS] for i in range(0, len(items), TXN_OPS)]
