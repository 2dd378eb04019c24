"""Reading and writing the files of the data folder: whole-file atomic replacement, reads that
open only regular files, and warnings said once per file version."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from engine.paths import atomic_write

# Opening a FIFO for reading blocks until a writer appears; non-blocking, the open returns
# at once and fstat tells it apart (the flag does not exist, nor do FIFOs, on Windows).
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers see either the old or the new file."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


def read_regular(path: Path) -> str:
    """The text of `path`; ValueError when it is not a regular file (a FIFO, a device or a
    folder given a .json name would block or fail the read), FileNotFoundError when absent."""
    fd = os.open(path, os.O_RDONLY | _NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        with os.fdopen(fd, "r", encoding="utf-8") as f:
            fd = -1  # the file object closes it
            return f.read()
    finally:
        if fd >= 0:
            os.close(fd)


class Once:
    """Log a warning about a file once per version of it (its modification time): a list
    read on every page event must not repeat the same line."""

    def __init__(self, log: logging.Logger):
        self.log = log
        self._said: set[tuple[str, int, str]] = set()

    def warn(self, path: Path, message: str, *args) -> None:
        try:
            version = os.stat(path).st_mtime_ns
        except OSError:
            version = 0
        key = (str(path), version, message % args)
        if key not in self._said:
            self._said.add(key)
            self.log.warning(message, *args)
