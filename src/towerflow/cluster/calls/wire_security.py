"""Who may talk to a task: every connection proves it knows the cluster token before its first message.

Two ZeroMQ mechanisms, both checked by a ZAP handler (pyzmq's `ThreadAuthenticator`) before
libzmq hands a single message of the connection to towerflow, so a stranger's bytes are never
unpickled:

* ``encrypt`` (CURVE, the default for a cluster that spans more than loopback): every task has
  the same key pair, derived from the token; a peer proves it holds the secret key in the
  handshake, and every frame after it is encrypted and authenticated (CurveZMQ).
* ``authenticate`` (ZeroMQ's PLAIN, the default on loopback): the peer presents a password
  derived from the token (an HMAC: the token itself is never sent). Frames are not encrypted;
  on loopback no other user can read them, across hosts anyone on the path could (and replay
  the password), which is why it is only a choice there (TOWERFLOW_WIRE_SECURITY).

A refused peer is named on stderr, with its address and the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import Optional

import zmq
import zmq.auth.thread

from towerflow import _log

ENCRYPT, AUTHENTICATE = "encrypt", "authenticate"
MODES = (ENCRYPT, AUTHENTICATE)
_USER = "towerflow"


def _derived(token: Optional[str], what: str) -> bytes:
    return hmac.new((token or "").encode(), f"towerflow wire {what}".encode(), hashlib.sha256).digest()


@dataclasses.dataclass(frozen=True)
class WireSecurity:
    """The mechanism and the keys every task of one cluster derives from its token."""

    mode: str
    token: Optional[str]

    @property
    def password(self) -> bytes:
        return _derived(self.token, "password").hex().encode()

    @property
    def secret_key(self) -> bytes:
        return zmq.utils.z85.encode(_derived(self.token, "curve secret"))

    @property
    def public_key(self) -> bytes:
        return zmq.curve_public(self.secret_key)

    def serve(self, socket: zmq.Socket) -> None:
        """Make `socket` accept only peers of this cluster (the context's gate checks them)."""
        if self.mode == ENCRYPT:
            socket.curve_server = True
            socket.curve_secretkey = self.secret_key
            socket.curve_publickey = self.public_key
        else:
            socket.plain_server = True

    def dial(self, socket: zmq.Socket) -> None:
        """Make `socket` present this cluster's credentials to the task it connects to."""
        if self.mode == ENCRYPT:
            socket.curve_serverkey = self.public_key
            socket.curve_publickey = self.public_key
            socket.curve_secretkey = self.secret_key
        else:
            socket.plain_username = _USER.encode()
            socket.plain_password = self.password

    def start_gate(self, context: zmq.Context, task: str) -> "_Gate":
        """The ZAP handler of `context`, whose serving sockets are `task`'s: it answers every handshake."""
        gate = _Gate(self, context, task)
        gate.start()
        if self.mode == ENCRYPT:
            gate.configure_curve_callback(domain="*", credentials_provider=gate)
        else:
            gate.configure_plain(domain="*", passwords={_USER: self.password.decode()})
        return gate


class _Gate(zmq.auth.thread.ThreadAuthenticator):
    """pyzmq's ZAP handler, saying on stderr whom it refused (the handler itself logs at debug level only)."""

    def __init__(self, security: WireSecurity, context: zmq.Context, task: str):
        super().__init__(context)
        self.security = security
        self._task = task
        self._address = "?"

    async def handle_zap_message(self, msg) -> None:
        if len(msg) >= 4:
            self._address = msg[3].decode(errors="replace")
        await super().handle_zap_message(msg)

    def callback(self, domain: str, client_key: bytes) -> bool:  # CURVE: the client's public key
        if hmac.compare_digest(client_key, self.security.public_key):
            return True
        self._refused("its CURVE key is not this cluster's (another cluster token)")
        return False

    def _authenticate_plain(self, domain: str, username: str, password: str):
        allowed, reason = super()._authenticate_plain(domain, username, password)
        if not allowed:
            self._refused("its password is not this cluster's (another cluster token, or "
                          "TOWERFLOW_WIRE_SECURITY differs between the tasks)")
        return allowed, reason

    def _refused(self, why: str) -> None:
        _log.get("cluster", self._task).warning(f"refused a connection from {self._address}: {why}. Give every task "
                                                "the same TOWERFLOW_CLUSTER_TOKEN.")
