"""Speed figures measured on this machine, for the Acceleration panel and Compare: each
finished reply's tokens per step and decoding speed, and each Compare's speed over Off on
the same prompt, with when they were taken and how busy the machine was meanwhile (the
share of its CPU that other programs used). Kept for the last few of each method, for one
loaded model (a new model, or a faster decode step, starts a new record)."""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass

import psutil

from engine.decode.stats import GenerationStats

KEEP = 8  # latest measures kept per method
# Other programs used more than this share of the CPU while a figure was taken: it is
# marked as taken on a busy machine (a browser drawing a streaming reply uses ~5-15%).
BUSY_SHARE = 0.25
IDLE_FIELDS = ("idle", "iowait", "guest", "guest_nice")  # guests are counted in user too
MIN_WATCH_S = 0.5  # shorter windows say nothing about the machine's load (clock ticks)


@dataclass(frozen=True)
class Measure:
    """One reply's (or one Compare's) figures."""

    when: float  # time.time() when it ended
    tokens_per_step: float  # tokens each full-model step added (1.0: plain decoding)
    tokens_per_s: float  # the reply's speed as its readout shows it (tokens / its time)
    drafted: float  # share of its steps that drafted anything
    busy: float | None  # share of the CPU other programs used meanwhile (None: unknown)
    vs_off: float | None = None  # Compare: its speed over Off's on the same prompt

    @property
    def was_busy(self) -> bool:
        return self.busy is not None and self.busy > BUSY_SHARE


def measure_of(stats: GenerationStats, busy: float | None,
               vs_off: float | None = None) -> Measure:
    """A reply's figures from its stats, as its readout shows them."""
    drafted = sum(d > 0 for d in stats.drafted) / len(stats.drafted) if stats.drafted else 0.0
    return Measure(time.time(), stats.mean_accepted or 1.0, stats.tokens_per_s, drafted, busy,
                   vs_off)


class CpuWatch:
    """The share of the machine's CPU that other programs used since it was made."""

    def __init__(self):
        self._start = _sample()

    def busy(self) -> float | None:
        """Other programs' share of all cores since the start (None where unknown)."""
        end = _sample()
        if self._start is None or end is None:
            return None
        wall = end[2] - self._start[2]
        if wall < MIN_WATCH_S:
            return None
        others = (end[0] - self._start[0]) - (end[1] - self._start[1])
        return min(1.0, max(0.0, others / (wall * (psutil.cpu_count() or 1))))


def _sample() -> tuple[float, float, float] | None:
    """(busy CPU seconds of the whole machine, of this process, wall seconds)."""
    try:
        total = psutil.cpu_times()
        mine = psutil.Process().cpu_times()
    except (psutil.Error, OSError):
        return None
    busy = sum(getattr(total, f) for f in total._fields if f not in IDLE_FIELDS)
    return busy, mine.user + mine.system, time.monotonic()


@dataclass(frozen=True)
class Summary:
    """What the recent replies of one method measured."""

    replies: int  # how many (at most KEEP)
    tokens_per_step: float  # median
    tokens_per_s: float  # median speed
    drafted: float  # share of all their steps that drafted (median per reply)
    busy: int  # of them, taken while the machine was busy


class SpeedRecord:
    """The latest measures per method (the method a reply was asked with: "auto", ...)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._replies: dict[str, deque[Measure]] = {}
        self._compares: dict[str, deque[Measure]] = {}

    def add_reply(self, method: str, measure: Measure) -> None:
        self._add(self._replies, method, measure)

    def add_compare(self, method: str, measure: Measure) -> None:
        self._add(self._compares, method, measure)

    def _add(self, where: dict, method: str, measure: Measure) -> None:
        with self._lock:
            where.setdefault(method, deque(maxlen=KEEP)).append(measure)

    def replies(self, method: str) -> Summary | None:
        """Medians over the method's latest replies; None before the first."""
        with self._lock:
            got = list(self._replies.get(method, ()))
        if not got:
            return None
        return Summary(len(got), statistics.median(m.tokens_per_step for m in got),
                       statistics.median(m.tokens_per_s for m in got),
                       statistics.median(m.drafted for m in got),
                       sum(m.was_busy for m in got))

    def last_compare(self, method: str) -> Measure | None:
        with self._lock:
            got = self._compares.get(method)
            return got[-1] if got else None
