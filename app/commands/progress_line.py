"""The CLI's progress line for every slow command (training, the speed report): redrawn in
place on a terminal; in a log, a line per stage and every few seconds, so logs stay short."""

from __future__ import annotations

import sys
import time

from engine.progress import Progress

BAR = 28  # bar width in characters
WIDTH = 120  # a redrawn line's width: the data stage's line with its rate, elapsed and ETA


class ProgressLine:
    """A ProgressFn that draws the reports on `stream`; `close()` ends the line."""

    def __init__(self, stream=None, every_s: float = 5.0, tty: bool | None = None):
        self.stream = stream or sys.stderr
        # redrawn in place on a terminal, unless other output shares it (`tty` False: the
        # app's server prints its own lines)
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s
        self.last_stage, self.last_message, self.last_print = "", "", 0.0
        self.start = time.perf_counter()

    def __call__(self, p: Progress) -> None:
        now = time.perf_counter()
        line = render(p, now - self.start)
        if self.tty:
            self.stream.write("\r" + line.ljust(WIDTH)[:WIDTH])
            self.stream.flush()
        elif (p.stage != self.last_stage or now - self.last_print >= self.every_s
              or (p.message != self.last_message and now - self.last_print >= 2.0)):
            self.stream.write(line + "\n")
            self.stream.flush()
            self.last_print = now
        self.last_stage, self.last_message = p.stage, p.message

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def render(p: Progress, elapsed_s: float) -> str:
    """`[data     ] [######......]  45% 300/686 conversations  elapsed 4:10  ETA 5:23`"""
    filled = int(BAR * p.fraction)
    eta = "" if p.eta_s is None else f"  ETA {_clock(p.eta_s)}"
    bar = f"[{'#' * filled}{'.' * (BAR - filled)}] {p.fraction * 100:3.0f}% " if p.total else ""
    return f"[{p.stage:<9}] {bar}{p.message}  elapsed {_clock(elapsed_s)}{eta}"


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"
