"""One screen, or the same screen redrawn in place every few seconds until `q` (or Ctrl-C).

`show` draws `frame()`; with `watch` it redraws every `watch` seconds, reading keys between
frames when stdin is a terminal (cbreak mode, restored on exit), and stops by itself once
`done()` says there is nothing more to wait for (a finished run: its last frame is the summary).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from typing import Callable, Iterator, Optional, TextIO

QUIT_KEYS = ("q", "Q", "\x1b", "\x04")  # q, Esc, Ctrl-D

KeyReader = Callable[[float], Optional[str]]  # wait up to `timeout` s for a key; None when none came


def is_quit(key: Optional[str]) -> bool:
    """Whether a key press ends the view."""
    return key is not None and key in QUIT_KEYS


def _sleep(timeout: float) -> Optional[str]:
    time.sleep(timeout)
    return None


@contextlib.contextmanager
def terminal_keys(stream=None) -> Iterator[KeyReader]:
    """A key reader for an interactive stdin (cbreak: keys arrive without Enter, still echo-free);
    a plain sleep when stdin is not a terminal or termios is missing (Windows)."""
    stream = stream or sys.stdin
    try:
        import termios
        import tty

        fd = stream.fileno()
        if not os.isatty(fd):
            raise OSError("not a terminal")
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):
        yield _sleep
        return

    def read(timeout: float) -> Optional[str]:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 1).decode(errors="replace") if ready else None

    tty.setcbreak(fd)
    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _wait(watch: float, keys: KeyReader) -> bool:
    """Wait `watch` seconds for keys; True when one of them quits."""
    deadline = time.monotonic() + watch
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if is_quit(keys(left)):
            return True


def show(frame: Callable[[], str], out: TextIO, watch: Optional[float] = None, max_frames: Optional[int] = None,
         done: Callable[[], bool] = lambda: False, keys: Optional[KeyReader] = None) -> int:
    frames = 0
    with contextlib.ExitStack() as stack:
        if keys is None:
            keys = stack.enter_context(terminal_keys()) if watch else _sleep
        try:
            while True:
                text = frame()
                if watch and out.isatty():
                    out.write("\x1b[H\x1b[2J")  # home + clear: redraw in place
                out.write(text + "\n")
                out.flush()
                frames += 1
                if not watch or done() or (max_frames is not None and frames >= max_frames):
                    return 0
                if _wait(watch, keys):
                    return 0
        except KeyboardInterrupt:
            return 0
