"""The etcd URL of a cluster's rendezvous store: `etcd://h1:2379,h2:2379,h3:2379/run-1`.

Read where the store is named: `towerflow launch --store`, TOWERFLOW_STORE (`taskenv`), and the cluster code
that opens it. Its errors name the flag or variable, the value and the form expected.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from towerflow.errors import TaskEnvironmentError

ETCD_SCHEME = "etcd://"
ETCD_PORT = 2379  # etcd's client port
ETCD_FORM = "etcd://HOST[:PORT][,HOST[:PORT]...][/PREFIX] (each member's client address, port 2379 by default)"


@dataclasses.dataclass(frozen=True)
class EtcdAddress:
    """Where a cluster keeps its rendezvous in etcd: the members to ask, and the run's key prefix
    (None: the rendezvous names it after the cluster spec)."""

    endpoints: Tuple[Tuple[str, int], ...]
    prefix: Optional[str] = None

    def url(self) -> str:
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        return ETCD_SCHEME + hosts + (f"/{self.prefix}" if self.prefix else "")


def is_etcd_url(text: Optional[str]) -> bool:
    return bool(text) and text.startswith(ETCD_SCHEME)


def parse_etcd_url(text: str, where: str) -> EtcdAddress:
    """`etcd://h1:2379,h2:2379/run-1` -> EtcdAddress; `where` (the flag or variable) names the value in errors."""
    def bad(problem: str) -> TaskEnvironmentError:
        return TaskEnvironmentError(f"{where}={text!r}: {problem}; expected {ETCD_FORM}, e.g. "
                                    "etcd://h1:2379,h2:2379,h3:2379")

    if not is_etcd_url(text):
        scheme = text.split("://", 1)[0] + "://" if "://" in text else None
        raise bad(f"{scheme!r} is not a store towerflow knows (only etcd:// is)" if scheme else "no etcd:// scheme")
    hosts, _, prefix = text[len(ETCD_SCHEME):].partition("/")
    endpoints = []
    for item in hosts.split(","):
        item = item.strip()
        host, port = item, str(ETCD_PORT)
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else port if not rest else "?"
        elif item.count(":") == 1:
            host, port = item.split(":")
        if not host or item.count(":") > 1 and not item.startswith("["):
            raise bad(f"{item!r} is not HOST or HOST:PORT (an IPv6 address goes in brackets: [fd00::1]:2379)")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise bad(f"the port of {item!r} is not a number between 1 and 65535")
        endpoints.append((host, int(port)))
    if len(set(endpoints)) != len(endpoints):
        raise bad("a member is named twice")
    prefix = prefix.strip("/")
    if prefix and any(not part or part in (".", "..") for part in prefix.split("/")):
        raise bad(f"the prefix {prefix!r} has an empty or relative part")
    return EtcdAddress(tuple(endpoints), prefix or None)
