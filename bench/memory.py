"""Peak memory of one generation: CUDA allocator peaks on a GPU, peak RSS on the CPU.

tracemalloc sees only Python objects, not torch's tensors, so the CPU figure comes from the
kernel: Linux keeps the process's resident-set high-water mark in /proc/self/status (VmHWM)
and resets it to the current RSS when "5" is written to /proc/self/clear_refs. Where that
reset is not possible the figure is the process's lifetime peak (getrusage), and says so.
"""

from __future__ import annotations

import re
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
MB = 1024 * 1024


@dataclass
class MemoryProbe:
    """Measures the peak around one call: start() before it, peak() after it."""

    device: torch.device
    method: str  # how peaks are measured, for the report (see describe())
    baseline_mb: float = 0.0  # memory in use when start() was called

    @classmethod
    def for_device(cls, device: torch.device) -> MemoryProbe:
        if device.type == "cuda":
            return cls(device, "cuda")
        return cls(device, "vmhwm" if _can_reset_hwm() else "ru_maxrss")

    def describe(self) -> str:
        return {
            "cuda": "torch.cuda.max_memory_allocated, reset before each generation",
            "vmhwm": "peak resident set size (VmHWM), reset before each generation",
            "ru_maxrss": "peak resident set size of the whole process so far (getrusage)",
        }[self.method]

    def start(self) -> None:
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_mb = torch.cuda.memory_allocated(self.device) / MB
        else:
            if self.method == "vmhwm":
                CLEAR_REFS.write_text("5")
            self.baseline_mb = _status_kb("VmRSS") / 1024

    def peak(self) -> tuple[float, float]:
        """(peak MB, peak minus the start() baseline in MB) since start()."""
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) / MB
        elif self.method == "vmhwm":
            peak = _status_kb("VmHWM") / 1024
        else:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak = rss / MB if sys.platform == "darwin" else rss / 1024  # bytes vs KiB
        return peak, max(0.0, peak - self.baseline_mb)


def _can_reset_hwm() -> bool:
    try:
        CLEAR_REFS.write_text("5")
        return _status_kb("VmHWM") > 0
    except OSError:
        return False


def _status_kb(key: str) -> float:
    """A `key: N kB` line of /proc/self/status; 0 where there is none (not Linux)."""
    try:
        match = re.search(rf"^{key}:\s+(\d+)", STATUS.read_text(), re.MULTILINE)
    except OSError:
        return 0.0
    return float(match.group(1)) if match else 0.0
