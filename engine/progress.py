"""Progress reports shared by every slow job (data generation, training, calibration) and
read by both the CLI progress bar and the UI."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Progress:
    """A snapshot of a running job."""

    stage: str  # "data" | "features" | "train" | "calibrate" | "save" | "done"
    done: float  # units finished in this stage
    total: float  # units in this stage (0 = unknown)
    message: str = ""  # one line for people
    eta_s: float | None = None  # seconds left in the whole job, when known
    metrics: dict = field(default_factory=dict)  # e.g. {"loss": 3.2, "head1_top1": 0.21}

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 0.0


ProgressFn = Callable[[Progress], None]


def ignore(_progress: Progress) -> None:
    """A ProgressFn that discards reports."""


@dataclass
class Eta:
    """Linear ETA for a stage: seconds left = elapsed / done * (total - done)."""

    total: float
    start: float = field(default_factory=time.perf_counter)

    def left(self, done: float) -> float | None:
        if done <= 0 or not self.total:
            return None
        elapsed = time.perf_counter() - self.start
        return max(0.0, elapsed / done * (self.total - done))
