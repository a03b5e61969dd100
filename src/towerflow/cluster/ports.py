"""Free ports held from the moment they are chosen until the tasks that listen on them are done.

A port chosen free and released at once can be taken before the task that was meant to listen on
it binds it: by another launch choosing free ports at the same moment, or by any outgoing
connection of the machine, whose source port the kernel draws from the same range. Two launches
on one machine (or two test workers) then fail with "address already in use".

So the launcher keeps one bound socket per port for the whole run (a scheduler rank that picks
its own port, for the life of its process). The socket is bound without
SO_REUSEADDR (the kernel gives it a port nobody else holds) and then marked SO_REUSEADDR without
ever listening: Linux then lets a task bind and listen on the same port as long as the task sets
SO_REUSEADDR too, which every listener a task starts does (c10d's TCPStore and gloo through
libuv or their own sockets; ZeroMQ's listeners too), while a plain `bind(port 0)` elsewhere and the kernel's
choice of source ports for outgoing connections both skip it. A restarted task finds its port
still held for it.
"""

from __future__ import annotations

import socket
from typing import List

LOOPBACK = "127.0.0.1"


class PortReservation:
    """`n` distinct free ports on `host`, held until `release()` (or the end of a `with` block)."""

    def __init__(self, n: int, host: str = LOOPBACK) -> None:
        self._socks: List[socket.socket] = []
        try:
            for _ in range(n):
                s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
                self._socks.append(s)
                s.bind((host, 0))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        except BaseException:
            self.release()
            raise
        self.ports: List[int] = [s.getsockname()[1] for s in self._socks]

    def release(self) -> None:
        for s in self._socks:
            s.close()
        self._socks = []

    def __enter__(self) -> "PortReservation":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"PortReservation(ports={self.ports}, held={bool(self._socks)})"
