"""The Redis URL a training job publishes its rows to: `towerflow launch --publish-to redis://HOST:PORT/DB`.

Read where the target is named: the launch's planning (refused before any task starts) and the ps task's
Redis sink. Its errors name the flag, the value and the form expected.
"""

from __future__ import annotations

from typing import Tuple
from urllib.parse import urlparse

from towerflow.errors import TaskEnvironmentError

REDIS_SCHEME = "redis://"
REDIS_PORT = 6379


def is_redis_url(target: str) -> bool:
    return target.startswith(REDIS_SCHEME)


def parse_redis_url(url: str, flag: str = "--publish-to") -> Tuple[str, int, int]:
    """(host, port, db) of redis://HOST[:PORT][/DB]."""
    parsed = urlparse(url)
    try:
        db = int(parsed.path.lstrip("/") or 0)
        port = parsed.port or REDIS_PORT
    except ValueError:
        db = port = -1
    if parsed.scheme != "redis" or not parsed.hostname or db < 0 or port < 0:
        raise TaskEnvironmentError(f"{flag} {url!r}: expected redis://HOST[:PORT][/DB] (e.g. redis://127.0.0.1:6379/0) "
                                   "or a folder")
    return parsed.hostname, port, db
