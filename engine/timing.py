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


class PlainStep:
    """One plain decode step of a loaded model, timed as often as asked at one position:
    the prompt is prefilled once, and each step writes the same cache row and is rolled
    back, so repeated timings cost a step each and the cache never grows."""

    def __init__(self, lm, prompt_len: int = 192):
        n = max(2, min(prompt_len, lm.context_len // 2))
        ids = [(7 * i) % int(lm.model.config.vocab_size) for i in range(1, n + 1)]
        self.lm, self.token, self.position = lm, ids[-1], n - 1
        self.cache = lm.target.new_cache()
        with torch.inference_mode():
            lm.target.forward(self.cache, ids[:-1], 0, last_only=True)
            self._step()  # warm

    def seconds(self, repeats: int = 3) -> float:
        """The fastest of `repeats` steps (the least disturbed by anything else running)."""
        with torch.inference_mode():
            return min(seconds(self.lm.device, self._step) for _ in range(repeats))

    def _step(self) -> None:
        out = self.lm.target.forward(self.cache, [self.token], self.position, last_only=True)
        int(out.logits[0, -1].argmax())  # a plain step reads its token back to the host
        self.lm.target.rollback(self.cache, 1)
