"""The page's settings, saved once a change is over: a number typed key by key sends a value
per key, and writing each would land them out of order (the page's events run side by side)
and write the file a dozen times. Each value replaces the one still waiting for its setting;
the file is written once typing has paused for `quiet_s`, or at once when something is
about to read it (a page load, a reply, the app's exit). Writes happen one at a time, in
the order they were asked for."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from app.store import Store
from engine.errors import QuickdraftError

log = logging.getLogger(__name__)

QUIET_S = 0.6  # a pause in typing this long ends a change (people type a key every ~0.2 s)


class PageSettings:
    """Settings and other small saves from the page, debounced (see the module)."""

    def __init__(self, store: Store, quiet_s: float = QUIET_S):
        self.store = store
        self.quiet_s = quiet_s
        self._lock = threading.Lock()  # guards the waiting values and the timer
        self._writing = threading.Lock()  # one write at a time, in order
        self._settings: dict = {}  # setting -> its latest value, not yet written
        self._saves: dict[str, Callable[[], None]] = {}  # key -> the latest save of it
        self._timer: threading.Timer | None = None
        self.problem = ""  # why the last write failed (said on the page's next change)

    def put(self, **settings) -> None:
        """Keep these values (already checked) until the change is over; one the file holds
        already, with no other waiting, is not written again."""
        saved = self.store.load_settings()
        with self._lock:
            new = {k: v for k, v in settings.items()
                   if k in self._settings or getattr(saved, k) != v}
            if not new:
                return
            self._settings.update(new)
            self._restart()

    def drop(self, key: str) -> None:
        """The setting's latest value cannot be saved: the one waiting for it is not either
        (the last value wins)."""
        with self._lock:
            self._settings.pop(key, None)

    @property
    def pending(self) -> dict:
        """The settings the next write will hold."""
        with self._lock:
            return dict(self._settings)

    def put_save(self, key: str, save: Callable[[], None]) -> None:
        """Run `save` once the change is over, unless a later one for `key` replaces it."""
        with self._lock:
            self._saves.pop(key, None)  # re-inserted last: the order of the latest changes
            self._saves[key] = save
            self._restart()

    def take_problem(self) -> str:
        """Why the last write failed ("" if it did not), said once."""
        problem, self.problem = self.problem, ""
        return problem

    def flush(self) -> None:
        """Write what is waiting now (before anything reads the settings)."""
        with self._writing:
            with self._lock:
                settings, saves = self._settings, self._saves
                self._settings, self._saves = {}, {}
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            try:
                if settings:
                    self.store.remember(**settings)
                for save in saves.values():
                    save()
            except (OSError, QuickdraftError) as exc:  # a full disk, a refused value
                self.problem = f"a setting could not be saved: {exc}"
                log.warning("%s", self.problem)

    def _restart(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(self.quiet_s, self.flush)
        self._timer.daemon = True
        self._timer.start()
