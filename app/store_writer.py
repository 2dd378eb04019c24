"""The datastore's disk writes, on a background thread: a reply's final update reaches the
page (or the API's client, or the terminal) first, and the next reply never waits on the
disk. Writes run one at a time in the order their documents were learned, which the
store's log needs (engine.datastore.disk.persist)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from pathlib import Path

from engine.datastore import disk
from engine.datastore.disk import Pending

log = logging.getLogger(__name__)


class StoreWriter:
    """A queue of datastore writes and the thread that runs it (started when there is
    work, gone when there is none, so an idle app holds no thread)."""

    def __init__(self) -> None:
        self._jobs: deque[tuple[Path, Pending]] = deque()
        self._idle = threading.Condition()  # guards _jobs and _running
        self._running = False

    def submit(self, path: Path, pending: Pending) -> None:
        """Write `pending` to the store at `path` after the writes submitted before it."""
        with self._idle:
            self._jobs.append((path, pending))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, daemon=True,
                                 name="quickdraft-datastore").start()

    def flush(self) -> None:
        """Wait until every submitted write is on disk (before a command exits)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._running)

    def _run(self) -> None:
        while True:
            with self._idle:
                if not self._jobs:
                    self._running = False
                    self._idle.notify_all()
                    return
                path, pending = self._jobs.popleft()
            try:
                disk.persist(path, pending)  # looked up here: tests slow the disk
            except Exception:  # noqa: BLE001 - e.g. a full disk; the thread must live on, or
                # flush() would wait forever. The reply stays in memory; it is in the chats too.
                log.exception("the datastore could not be written to %s", path)
