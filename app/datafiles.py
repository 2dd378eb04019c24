"""Writing the files of the data folder (whole-file atomic replacement) and warnings about
them said once per file version. Reading is engine/stored_files.py's."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from engine.paths import atomic_write


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers see either the old or the new file."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


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
