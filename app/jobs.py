"""Background jobs (loading a model, training an accelerator) that the page polls."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.failures import report
from engine.errors import QuickdraftError
from engine.progress import Progress

log = logging.getLogger(__name__)

HISTORY_LIMIT = 5000  # metric reports kept per job for the live plots
WHAT = {"load": "loading the model", "train": "training"}  # a job's kind, for people


@dataclass
class Job:
    """A background job (loading a model, training an accelerator) that the UI polls."""

    kind: str  # "load" | "train"
    title: str  # what it works on, for people
    method: str = ""  # training: the method being trained
    cancel: threading.Event = field(default_factory=threading.Event)  # set: stop soon
    started: float = field(default_factory=time.monotonic)  # monotonic clock at creation
    state: str = "running"  # "running" | "done" | "cancelled" | "failed"
    progress: Progress | None = None  # the latest report
    fraction: float = 0.0  # share of the whole job done (run_fraction): never goes back
    history: list[dict] = field(default_factory=list)  # {"t": s, **metrics} for the plots
    error: str = ""  # one line when failed
    result: object = None  # what the work returned
    thread: threading.Thread | None = None  # the worker, once started

    @property
    def running(self) -> bool:
        return self.state == "running"

    def report(self, progress: Progress) -> None:
        """A ProgressFn: keep the latest snapshot, the share done and the metrics history."""
        self.progress = progress
        elapsed = time.monotonic() - self.started
        self.fraction = max(self.fraction, run_fraction(progress, elapsed))
        if progress.metrics:
            self.history.append({"t": elapsed, **progress.metrics})
            del self.history[:-HISTORY_LIMIT]

    def start(self, work: Callable[[], object]) -> Job:
        self.thread = threading.Thread(target=self._run, args=(work,), daemon=True,
                                       name=f"quickdraft-{self.kind}")
        self.thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job ends; False on timeout."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _run(self, work: Callable[[], object]) -> None:
        try:
            self.result = work()
            self.state = "cancelled" if self.cancel.is_set() else "done"
        except QuickdraftError as exc:
            self.error, self.state = str(exc), "cancelled" if self.cancel.is_set() else "failed"
        except Exception as exc:  # a background thread must report, not die silently
            self.error = report(log, WHAT.get(self.kind, self.kind), exc)
            self.state = "failed"


def run_fraction(p: Progress, elapsed_s: float) -> float:
    """Share of a job done after `elapsed_s`: the time spent against the time spent plus
    the job's ETA where the report has one (a training run's covers the whole run, so its
    stages, each counted from 0 to 1, do not restart the bar), else the stage's own share
    (a download's bytes)."""
    if p.stage == "done":
        return 1.0
    if p.eta_s is not None and elapsed_s + p.eta_s > 0:
        return min(1.0, elapsed_s / (elapsed_s + p.eta_s))
    return p.fraction


def one_line(exc: BaseException) -> str:
    """An unexpected exception for the terminal: its type and first non-empty message line
    (the traceback goes to the log; the page shows app.failures.report's line instead)."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first.strip()}" if first else type(exc).__name__
