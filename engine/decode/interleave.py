"""Timing several ways of decoding on one machine: every way runs on an item before the
next item, in an order that rotates from item to item. Machines drift (other jobs, clocks,
thermals); interleaving spreads that drift over all ways alike, so per-item ratios stay fair.
Calibration and the speed report both time this way."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def interleaved(names: Sequence[str], items: Sequence[Item],
                run: Callable[[str, Item], Result],
                cancel: threading.Event | None = None) -> Iterator[tuple[int, dict[str, Result]]]:
    """Yield (item index, name -> run(name, item)) for each item in turn, the names run in
    an order rotated by one more from item to item; stop early once `cancel` is set."""
    names = list(names)
    for n, item in enumerate(items):
        if cancel is not None and cancel.is_set():
            return
        shift = n % len(names)
        yield n, {name: run(name, item) for name in names[shift:] + names[:shift]}
