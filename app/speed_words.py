"""The Acceleration panel's words about speed: every figure says where it was measured and
under what conditions. What replies measured on this machine comes first (app/speed_record.py);
an accelerator's own estimate follows with when it was taken and how busy the machine was;
a method measured slower than Off says so (never in green) and what Auto does about it.
Pure formatting over figures and the drafter's own verdict (Drafter.pays_off, .speedup)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from app.speed_record import BUSY_SHARE, Measure, SpeedRecord
from engine.decode.drafter import Drafter


@dataclass(frozen=True)
class Taken:
    """When a figure was taken, and how busy the machine was meanwhile."""

    when: float  # time.time()
    busy: float | None  # share of the CPU other programs used (None: unknown)

    @property
    def was_busy(self) -> bool:
        return self.busy is not None and self.busy > BUSY_SHARE

    def words(self) -> str:
        """"at 14:02" or "at 14:02, while other programs used 63% of the CPU"."""
        at = f"at {clock(self.when)}"
        if self.was_busy:
            return f"{at}, while other programs used {100 * self.busy:.0f}% of the CPU"
        return at


def clock(when: float) -> str:
    return time.strftime("%H:%M", time.localtime(when))


def speed_words(label: str, calibrated: float | None, retimed: float | None,
                shipped: bool, taken: Taken | None = None) -> str:
    """Where an accelerator's own speed estimate comes from: calibration when it was
    trained (on the machine it was built on, for a shipped one), and the estimate re-timed
    when this model loaded (in another dtype or on another device), with when and how busy
    the machine was then: a busy machine times every step slower, and the estimate with it."""
    where = "on the machine it was built on" if shipped else "when it was trained"
    measured = f"calibration measured {calibrated:.2f}× {where}" if calibrated else ""
    if retimed is None:
        return f"{label}: {measured[0].upper() + measured[1:]}." if measured else ""
    when = f" ({taken.words()})" if taken is not None else ""
    line = f"{label}: estimated {retimed:.2f}× plain decoding when the model loaded{when}"
    line += f"; {measured}" if measured else ""
    if taken is not None and taken.was_busy:
        line += ". Taken on a busy machine: reload the model when it is idle to time it again"
    return line + "."


def ready_line(label: str, speed: str, drafter: Drafter) -> str:
    """A ready accelerator: how fast its own estimate says it is, and, where that estimate
    says it does not pay here, that it does not draft and why."""
    if not drafter.pays_off:
        x = drafter.speedup
        why = ("it did not beat plain decoding here" if x is None
               else f"estimated {x:.2f}× here")
        return (f"{label} is loaded but not drafting: {why}, so it decodes plainly "
                f"(Off is as fast).{' ' + speed if speed else ''}")
    return f"{label} is ready." + (f" {speed}" if speed else "")


def measured_lines(method: str, label: str, record: SpeedRecord) -> list[str]:
    """What replies and Compare measured for `method` on this machine, newest figures."""
    mine, off = record.replies(method), record.replies("off")
    lines = []
    if mine is not None:
        n = mine.replies
        line = (f"Measured here, your last {n} repl{'ies' if n > 1 else 'y'} with {label}: "
                f"{mine.tokens_per_step:.2f} tokens/step, {mine.tokens_per_s:.1f} tok/s")
        if method != "off" and off is not None and off.tokens_per_s > 0:
            ratio = mine.tokens_per_s / off.tokens_per_s
            line += (f" (Off: {off.tokens_per_s:.1f} tok/s over {off.replies} "
                     f"repl{'ies' if off.replies > 1 else 'y'}: {ratio:.2f}× Off, on "
                     "different prompts)")
        busy = mine.busy + (off.busy if off is not None and method != "off" else 0)
        if busy:
            line += f"; {busy} of them ran while other programs used over a quarter of the CPU"
        lines.append(line + ".")
        if method != "off" and mine.drafted == 0:
            lines.append(f"{label} drafted none of the steps of these replies: every step was "
                         "plain decoding.")
    compare = record.last_compare(method)
    if compare is not None and compare.vs_off is not None:
        taken = Taken(compare.when, compare.busy)
        if compare.drafted == 0:  # Off's own steps: the ratio is the clock's noise
            lines.append(f"Compare {taken.words()}: no draft kept, the same steps as Off, so "
                         f"its {compare.vs_off:.2f}× Off on the same prompt is timing noise.")
        else:
            lines.append(f"Compare {taken.words()}: {compare.vs_off:.2f}× Off on the same "
                         f"prompt, {compare.tokens_per_step:.2f} tokens/step.")
    if not lines and method != "off":
        lines.append(f"Not measured in replies on this machine yet: send a message with "
                     f"{label}, or press Compare to time it against Off on the same prompt.")
    return lines


def slower(method: str, record: SpeedRecord) -> float | None:
    """The latest measured speed over Off when it is below 1 (Compare first, else replies
    against Off's); None when faster, not measured, or nothing was drafted (Off's own
    steps, slower only by the clock's noise)."""
    compare: Measure | None = record.last_compare(method)
    if compare is not None and compare.vs_off is not None:
        return compare.vs_off if compare.vs_off < 1.0 and compare.drafted > 0 else None
    mine, off = record.replies(method), record.replies("off")
    if mine is None or off is None or not off.tokens_per_s or mine.drafted == 0:
        return None
    ratio = mine.tokens_per_s / off.tokens_per_s
    return ratio if ratio < 1.0 else None


def what_auto_does(method: str, label: str, ratio: float, drafter: Drafter,
                   estimate: Taken | None) -> str:
    """A method measured slower than Off: what Auto does about it, from the drafter's own
    verdict (Auto leaves out a source that does not pay, and prices every draft by the step
    costs timed when the model loaded)."""
    head = f"⚠ {label} ran at {ratio:.2f}× Off here: slower than plain decoding."
    timed = f" (timed {estimate.words()})" if estimate is not None else ""
    if method == "auto":
        return (f"{head} Auto drafts only where the step costs timed when the model loaded"
                f"{timed} say a draft pays, and copies where the reply repeats earlier text; "
                "choose Off while it stays faster on your prompts.")
    if not drafter.pays_off:
        return f"{head} Auto leaves {label} out here: its own estimate says it does not pay."
    x = f" ({drafter.speedup:.2f}×{timed})" if drafter.speedup is not None else timed
    return (f"{head} Auto still drafts with {label} where its own estimate here{x} says it "
            f"pays; choose Off while {label} stays slower on your prompts.")
