"""Timing work on the model's device: CUDA kernels run asynchronously, so the clock is read
only once the device has finished what was queued before and during the timed call."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: torch.device | None = None) -> None:
    """Wait for the CUDA device's queued kernels (`device` None: the current one, if any);
    nothing to wait for elsewhere."""
    if device is None and torch.cuda.is_available():
        torch.cuda.synchronize()
    elif device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(device: torch.device | None, fn: Callable, *args) -> float:
    """Wall seconds of fn(*args) on `device`, its queued kernels included."""
    sync(device)
    start = time.perf_counter()
    fn(*args)
    sync(device)
    return time.perf_counter() - start
