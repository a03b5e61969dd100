"""A client of etcd's v3 API through its JSON gateway (`/v3/kv/...`), on the standard library alone.

Why this and not a package: torch's own `EtcdStore` speaks etcd's v2 API through `python-etcd`
(unmaintained since 2018; v2 is off by default in etcd 3.4 and gone in 3.6) and lacks the
compare-and-set and delete the cluster code needs; `etcd3gw` talks to one endpoint only and
brings requests, futurist and pbr. Here every call goes to the member that answered last and
moves on to the next one when a member is down, within a deadline, so a lost member costs one
connect and an unreachable etcd a bounded `EtcdUnavailable`, never a hang. Measured against
both: docs/cluster.md, "The store".

Keys and values are bytes; the JSON API carries them in base64 and 64-bit integers as strings.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

CONNECT_TIMEOUT = 1.0  # seconds to open a connection to one member before trying the next
REPLY_TIMEOUT = 2.0  # seconds one member has to answer: a request caught in a leader election is retried after this
RETRY_PAUSE = 0.1  # after every member failed once, before the next round


class EtcdUnavailable(ConnectionError):
    """Raised when no member of the etcd cluster answered within the deadline (each member's error named)."""


class EtcdRequestError(RuntimeError):
    """Raised when etcd answered a request with an error that retrying elsewhere does not cure."""


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: Optional[str]) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with `prefix` (etcd's range_end for a prefix)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


class EtcdClient:
    """Calls to an etcd cluster at `endpoints` ([(host, port), ...]); safe to share between threads
    (each thread keeps its own connection)."""

    def __init__(self, endpoints: Sequence[Tuple[str, int]], deadline: float = 30.0):
        if not endpoints:
            raise ValueError("an etcd client needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.deadline = deadline  # seconds a call may spend looking for a member that answers
        self._local = threading.local()
        self._preferred = 0  # the member that answered last: calls start there

    def describe(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    # --- one request, whichever member answers --------------------------------------------

    def call(self, path: str, body: dict, deadline: Optional[float] = None) -> dict:
        """POST `body` to /v3/`path` on the first member that answers; EtcdUnavailable past `deadline` s."""
        limit = self.deadline if deadline is None else deadline
        end = time.monotonic() + limit
        data = json.dumps(body).encode()
        errors: Dict[str, str] = {}
        while True:
            start = self._preferred
            for step in range(len(self.endpoints)):
                i = (start + step) % len(self.endpoints)
                if step and time.monotonic() >= end:
                    break
                try:
                    reply = self._post(i, "/v3/" + path, data, end)
                except (OSError, http.client.HTTPException) as e:
                    self._drop(i)
                    errors[self._name(i)] = f"{type(e).__name__}: {e}"
                    continue
                except _Retry as e:
                    errors[self._name(i)] = str(e)
                    continue
                self._preferred = i
                return reply
            if time.monotonic() >= end:
                said = "; ".join(f"{k}: {v}" for k, v in errors.items())
                raise EtcdUnavailable(f"no etcd member answered within {limit:.3g} s ({said})")
            time.sleep(RETRY_PAUSE)

    def _name(self, i: int) -> str:
        host, port = self.endpoints[i]
        return f"{host}:{port}"

    def _connection(self, i: int) -> http.client.HTTPConnection:
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(i)
        if conn is None:
            host, port = self.endpoints[i]
            conn = conns[i] = http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT)
        return conn

    def _drop(self, i: int) -> None:
        conn = self._local.__dict__.get("conns", {}).pop(i, None)
        if conn is not None:
            conn.close()

    def _post(self, i: int, path: str, data: bytes, end: float) -> dict:
        conn = self._connection(i)
        fresh = conn.sock is None
        if fresh:
            conn.timeout = max(0.05, min(CONNECT_TIMEOUT, end - time.monotonic()))
            conn.connect()
        conn.sock.settimeout(max(0.05, min(REPLY_TIMEOUT, end - time.monotonic())))
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            if fresh:
                raise
            self._drop(i)  # a kept-alive connection the member closed meanwhile: once more on a new one
            return self._post(i, path, data, end)
        text = response.read()
        reply = json.loads(text) if text else {}
        if response.status == 200 and "error" not in reply:
            return reply.get("result", reply) if path.endswith("/keepalive") else reply
        message = reply.get("message") or reply.get("error") or text[:200]
        if response.status >= 500 or "leader" in str(message) or "timed out" in str(message):
            raise _Retry(f"HTTP {response.status}: {message}")  # this member cannot serve it now: another may
        raise EtcdRequestError(f"etcd refused {path}: HTTP {response.status}: {message}")

    # --- the calls the store needs ---------------------------------------------------------

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self.call("kv/put", _put(key, value, lease))

    def range(self, key: bytes, end: Optional[bytes] = None, count_only: bool = False) -> dict:
        body = {"key": b64(key)}
        if end is not None:
            body["range_end"] = b64(end)
        if count_only:
            body["count_only"] = True
        return self.call("kv/range", body)

    def get(self, key: bytes) -> Optional[dict]:
        """The key's entry ({'value': bytes, 'mod_revision': int, ...}) or None."""
        kvs = self.range(key).get("kvs") or []
        return entry(kvs[0]) if kvs else None

    def delete(self, key: bytes) -> int:
        return int(self.call("kv/deleterange", {"key": b64(key)}).get("deleted", 0))

    def txn(self, compare: List[dict], success: List[dict], failure: List[dict] = ()) -> Tuple[bool, List[dict]]:
        """One transaction: (whether every comparison held, the responses of the branch taken)."""
        reply = self.call("kv/txn", {"compare": compare, "success": success, "failure": list(failure)})
        return bool(reply.get("succeeded", False)), reply.get("responses") or []

    def grant(self, ttl: int) -> int:
        return int(self.call("lease/grant", {"TTL": ttl})["ID"])

    def keepalive(self, lease: int, deadline: Optional[float] = None) -> int:
        """Renew the lease; its TTL in seconds, 0 when it has expired."""
        return int(self.call("lease/keepalive", {"ID": str(lease)}, deadline).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        try:
            self.call("lease/revoke", {"ID": str(lease)}, deadline=2.0)
        except (EtcdUnavailable, EtcdRequestError):
            pass  # it expires by itself

    def health(self, deadline: float) -> str:
        """The cluster's version from the first member that answers (EtcdUnavailable past `deadline` s)."""
        return self.call("maintenance/status", {}, deadline).get("version", "?")


class _Retry(Exception):
    """A member answered but cannot serve the request now (no leader, a timeout inside etcd)."""


def entry(kv: dict) -> dict:
    return {"key": unb64(kv.get("key")), "value": unb64(kv.get("value")),
            "mod_revision": int(kv.get("mod_revision", 0)), "version": int(kv.get("version", 0))}


def _put(key: bytes, value: bytes, lease: int) -> dict:
    body = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return body


def put_op(key: bytes, value: bytes, lease: int = 0) -> dict:
    return {"request_put": _put(key, value, lease)}


def range_op(key: bytes) -> dict:
    return {"request_range": {"key": b64(key)}}


def compare(key: bytes, target: str, value, result: str = "EQUAL") -> dict:
    """A transaction's comparison: target VALUE (bytes), MOD / VERSION / CREATE (revisions, ints)."""
    field = {"VALUE": "value", "MOD": "mod_revision", "VERSION": "version", "CREATE": "create_revision"}[target]
    return {"key": b64(key), "target": target, "result": result,
            field: b64(value) if target == "VALUE" else str(value)}


def range_kvs(response: dict) -> List[dict]:
    """The entries of one `request_range` response of a transaction."""
    return [entry(kv) for kv in (response.get("response_range") or {}).get("kvs") or []]
