"""One screen, or the same screen redrawn in place every few seconds until Ctrl-C."""

from __future__ import annotations

import time
from typing import Callable, Optional, TextIO


def show(frame: Callable[[], str], out: TextIO, watch: Optional[float] = None, max_frames: Optional[int] = None) -> int:
    frames = 0
    try:
        while True:
            text = frame()
            if watch and out.isatty():
                out.write("\x1b[H\x1b[2J")  # home + clear: redraw in place
            out.write(text + "\n")
            out.flush()
            frames += 1
            if not watch or (max_frames is not None and frames >= max_frames):
                return 0
            time.sleep(watch)
    except KeyboardInterrupt:
        return 0
