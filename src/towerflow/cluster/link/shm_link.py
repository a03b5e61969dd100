"""Same-host calls whose tensors live in shared memory and whose doorbell is a pipe.

Between two tasks of one host a remote call through the network stack costs hundreds of µs of round trip,
thread hand-offs and serialization (docs/benchmarks.md, "The ps step on a small model"); a
parameter server's step on a small model is mostly that. A link is a fixed-shape
request/reply channel for one caller: two slots of request tensors and two of reply tensors,
mapped from files in /dev/shm (`torch.from_file(shared=True)`: PyTorch's shared memory), and
two named pipes. The request pipe carries a small pickled header (the slot and the typed
message without its tensors), the reply pipe the same back. The files and pipes are unlinked
once both ends have opened them: nothing is left behind, even when a process dies.

A dead peer reads as end-of-file on its pipe: the caller's wait fails with `ConnectionLost`, and
the serving loop ends. The caller reads its replies in the thread that waits for them (no
reader thread, no hand-off: one wake-up per reply); it waits for a slot's reply before reusing it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import os
import pickle
import re
import select
import struct
import threading
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from towerflow.errors import ConnectionLost
SHM_DIR = "/dev/shm"
SLOTS = 2  # one slot may be in flight while the caller fills the other
_LENGTH = struct.Struct("<I")
_NO_LOCK = contextlib.nullcontext()  # the caller's end is written by one thread

TensorSpecs = Tuple[Tuple[int, torch.dtype], ...]  # (numel, dtype) of each tensor of a slot


@dataclasses.dataclass(frozen=True)
class LinkOffer:
    """What the caller sends (over remote calls) to the task that will serve the link: where its files are."""

    prefix: str  # /dev/shm/towerflow-link-<pid>-<random>: the files are prefix + ".q<k>.<i>", ".r<k>.<i>", ".in", ".out"
    requests: TensorSpecs
    replies: TensorSpecs

    def path(self, suffix: str) -> str:
        return f"{self.prefix}.{suffix}"


def mapped(path: str, numel: int, dtype: torch.dtype, create: bool) -> torch.Tensor:
    size = max(numel, 1)
    if create:  # reserve the memory now: a full /dev/shm fails here (ENOSPC), not later as a SIGBUS on first write
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size * torch.empty(0, dtype=dtype).element_size())
        finally:
            os.close(fd)
    elif not os.path.exists(path):
        raise FileNotFoundError(path)  # torch.from_file would create it: another host's file is not here
    return torch.from_file(path, shared=True, size=size, dtype=dtype)[:numel]


_NAMED = re.compile(r"towerflow-(?:link|ring)-(\d+)-[0-9a-f]{32}\.")


def new_prefix(kind: str, directory: str) -> str:
    """A fresh name for a link's or a ring's files, with this process's pid in it. The files are unlinked once both
    ends opened them, but a creator killed in between leaves them behind: each new name first removes the files of
    creators that are no longer running (network-namespace hosts share this directory and the pids)."""
    try:
        names = os.listdir(directory)
    except OSError:
        names = []
    for name in names:
        match = _NAMED.match(name)
        if match and not _running(int(match.group(1))):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:  # another process swept it first
                pass
    return os.path.join(directory, f"towerflow-{kind}-{os.getpid()}-{uuid.uuid4().hex}")


def unlink_all(paths) -> None:
    """Remove these names, those already gone included."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _slots(offer: LinkOffer, kind: str, specs: TensorSpecs, create: bool) -> List[List[torch.Tensor]]:
    return [[mapped(offer.path(f"{kind}{k}.{i}"), n, d, create) for i, (n, d) in enumerate(specs)]
            for k in range(SLOTS)]


def _blocking(fd: int) -> int:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def _write_frame(fd: int, lock, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:  # replies may be sent from several threads (a sync pull is answered by another worker's push)
        view = memoryview(_LENGTH.pack(len(data)) + data)
        while view:
            view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> Optional[bytes]:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None  # end of file: the writer is gone
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _read_frame(fd: int) -> Optional[Any]:
    head = _read_exact(fd, _LENGTH.size)
    if head is None:
        return None
    body = _read_exact(fd, _LENGTH.unpack(head)[0])
    return None if body is None else pickle.loads(body)


class LinkClient:
    """The caller's end: owns the shared tensors and the pipes. `call(slot, header)` sends, `reply(slot)` waits
    for that slot's reply header in the calling thread (no reader thread: the kernel wakes the waiter itself)."""

    def __init__(self, requests: TensorSpecs, replies: TensorSpecs, directory: str = SHM_DIR):
        """Raises OSError when the slots do not fit in `directory` (ENOSPC); nothing is left behind then."""
        self.offer = LinkOffer(new_prefix("link", directory), tuple(requests), tuple(replies))
        self._paths = [self.offer.path(f"{kind}{k}.{i}") for kind, specs in (("q", requests), ("r", replies))
                       for k in range(SLOTS) for i in range(len(specs))] + [self.offer.path("in"), self.offer.path("out")]
        try:
            self.requests = _slots(self.offer, "q", self.offer.requests, create=True)
            self.replies = _slots(self.offer, "r", self.offer.replies, create=True)
            os.mkfifo(self.offer.path("in"))
            os.mkfifo(self.offer.path("out"))
        except OSError:  # e.g. ENOSPC: /dev/shm too small for the slots; leave nothing behind
            self.unlink()
            raise
        # open the reply pipe first (without waiting for a writer), so that the server's open for writing succeeds
        self._reply_fd: Optional[int] = os.open(self.offer.path("out"), os.O_RDONLY | os.O_NONBLOCK)
        # and hold the request pipe's write end from the start (read-write: Linux opens a pipe so without waiting),
        # so that the server's first read waits for a request instead of seeing end of file
        self._request_fd: Optional[int] = os.open(self.offer.path("in"), os.O_RDWR)
        self._in_flight: set = set()
        self._arrived: Dict[int, tuple] = {}  # replies read while waiting for another slot's
        self._closed: Optional[str] = None
        self._hangup: Optional[select.poll] = None

    def connect(self) -> None:
        """The server has opened its ends (its serve call returned True): drop the names."""
        _blocking(self._reply_fd)
        self.unlink()

    def unlink(self) -> None:
        """Remove the files' names (the mappings and open pipes stay valid)."""
        unlink_all(self._paths)

    def call(self, slot: int, header: Any) -> None:
        """Send `header` for the request tensors of `slot` (filled by the caller); `reply(slot)` waits for the answer."""
        if self._closed is not None:
            raise ConnectionLost(self._closed)
        if slot in self._in_flight:
            raise RuntimeError(f"internal: slot {slot} of the link is still in flight")
        self._in_flight.add(slot)
        try:
            _write_frame(self._request_fd, _NO_LOCK, (slot, header))
        except OSError as e:  # EPIPE: the server is gone
            raise self._close_for(f"the link's server is gone: {e}") from None

    def reply(self, slot: int, idle: Optional[Callable[[], None]] = None, every: float = 1.0) -> Any:
        """Wait for `slot`'s reply header and return it (or raise the server's error, or ConnectionLost). `idle()` runs
        every `every` seconds while nothing arrives (a caller watching its peers' heartbeats raises from it)."""
        while slot not in self._arrived:
            if self._closed is not None:
                raise ConnectionLost(self._closed)
            if idle is not None and not select.select([self._reply_fd], [], [], every)[0]:
                idle()
                continue
            try:
                frame = _read_frame(self._reply_fd)
            except OSError as e:
                raise self._close_for(f"the link's server is gone ({e})") from None
            if frame is None:
                raise self._close_for("the link's server is gone (end of file on the reply pipe)")
            self._arrived[frame[0]] = frame[1:]
        self._in_flight.discard(slot)
        ok, payload = self._arrived.pop(slot)
        if not ok:
            raise payload
        return payload

    def peer_gone(self) -> bool:
        """Whether the server's end is closed (its process ended), asked without waiting or reading a reply."""
        if self._closed is not None:
            return True
        if self._hangup is None:
            self._hangup = select.poll()
            self._hangup.register(self._reply_fd, select.POLLHUP)  # POLLHUP: the reply pipe has no writer left
        return any(events & (select.POLLHUP | select.POLLERR) for _, events in self._hangup.poll(0))

    def _close_for(self, why: str) -> ConnectionLost:
        self._closed = why
        return ConnectionLost(why)

    def __del__(self) -> None:  # a link dropped unclosed (its thread ended) must still hang up on its server
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        """Stop using the link: later calls fail, the server's loop sees end of file."""
        self.unlink()
        for fd in (self._request_fd, self._reply_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._request_fd = self._reply_fd = None
        if self._closed is None:
            self._closed = "the link was closed by its caller"


# handler(header, request tensors, reply tensors) -> the reply header, or a future of it (answered when done)
Handler = Callable[[Any, List[torch.Tensor], List[torch.Tensor]], Any]


def serve(offer: LinkOffer, handler: Handler, name: str = "towerflow-link-server",
          on_end: Optional[Callable[[], None]] = None, after: Optional[Callable[[], None]] = None) -> bool:
    """Serve `offer` in a thread: handler(header, request tensors, reply tensors) returns the reply header, or a
    future of it, having written (or writing, before it completes) the reply tensors. False when the offer's files are
    not on this host (the caller then keeps using remote calls). `on_end()` runs in that thread once the caller is gone (not
    when this process exits); `after()` after each call is answered (or its answer deferred): work that may wait, done
    while the caller computes its next call."""
    try:
        requests = _slots(offer, "q", offer.requests, create=False)
        replies = _slots(offer, "r", offer.replies, create=False)
        request_fd = _blocking(os.open(offer.path("in"), os.O_RDONLY | os.O_NONBLOCK))
    except FileNotFoundError:
        return False
    try:
        reply_fd = _blocking(os.open(offer.path("out"), os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: the caller is no longer reading
        os.close(request_fd)
        return False
    lock = threading.Lock()
    wake = _process_wake()

    def _send(slot: int, ok: bool, payload: Any) -> None:
        try:
            _write_frame(reply_fd, lock, (slot, ok, payload))
        except OSError:  # the caller is gone; the loop sees end of file and stops
            pass

    def answer(slot: int, future: torch.futures.Future) -> None:
        try:
            value = future.value()
        except Exception as e:  # the handler's error goes back to the caller, as a remote call's would
            _send(slot, False, e)
        else:
            _send(slot, True, value)

    def loop() -> None:
        try:
            while True:
                if wake.r in select.select([request_fd, wake.r], [], [])[0]:
                    return  # the process stops serving, or exits (`stop_servers`)
                frame = _read_frame(request_fd)
                if frame is None:
                    if on_end is not None:
                        on_end()
                    return
                slot, header = frame
                try:
                    result = handler(header, requests[slot], replies[slot])
                except Exception as e:
                    _send(slot, False, e)
                    continue
                if isinstance(result, torch.futures.Future):
                    result.add_done_callback(lambda f, slot=slot: answer(slot, f))
                else:
                    _send(slot, True, result)
                if after is not None:
                    after()
        finally:
            for fd in (request_fd, reply_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass

    thread = threading.Thread(target=loop, name=name, daemon=True)
    wake.threads.append(thread)
    thread.start()
    return True


class _Wake:
    """One pipe per process that wakes every serving loop when the process exits: a loop must not be inside a
    torch call while the interpreter tears torch down (a ps whose script raised was seen to abort so). Made on the
    first link served, and again in a forked child: a pipe inherited through a fork would be shared with the parent
    and every sibling, and one task's exit would end the others' links."""

    def __init__(self):
        self.pid = os.getpid()
        self.r, self.w = os.pipe()
        self.threads: List[threading.Thread] = []

    def stop(self, timeout: float = 2.0) -> None:
        os.write(self.w, b"x")
        for thread in self.threads:
            thread.join(timeout)


_wake: Optional[_Wake] = None
_wake_lock = threading.Lock()


def _process_wake() -> _Wake:
    global _wake
    with _wake_lock:
        if _wake is None or _wake.pid != os.getpid():
            _wake = _Wake()
        return _wake


def stop_servers() -> None:
    """Wake and join this process's serving loops (not those of the process it was forked from), each closing its
    pipes, so that every caller sees its server gone: when this process stops serving its cluster, and at exit."""
    global _wake
    with _wake_lock:
        wake = _wake if _wake is not None and _wake.pid == os.getpid() else None
        _wake = None  # a link served later gets a wake pipe of its own
    if wake is not None:
        wake.stop()


atexit.register(stop_servers)


def same_host(address_a: str, address_b: str) -> bool:
    """Whether two tasks' `host:port` addresses name the same host (the name as written: a link is only
    tried then, so tasks given distinct host names keep remote calls even when they share a machine)."""
    return address_a.rsplit(":", 1)[0] == address_b.rsplit(":", 1)[0]
