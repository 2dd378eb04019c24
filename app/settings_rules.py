"""What each saved setting may hold. settings.json is the app's own file, but people edit it
and older versions wrote it: a value of the right type and a wrong value must cost only that
setting (its default, with one line naming the file and the key), never the start-up."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from engine.config import QUANT_CHOICES
from engine.drafters.registry import ACCEL_CHOICES

MAX_NEW_TOKENS = 32_768  # the longest reply the page's slider could ask for, with headroom
CONVERSATION_ID = re.compile(r"[0-9a-f]{1,32}")  # conversation ids, which name their files


def _finite(low: float, high: float, low_open: bool = False) -> Callable[[float], str | None]:
    def check(value: float) -> str | None:
        inside = (low < value if low_open else low <= value) and value <= high
        if math.isfinite(value) and inside:
            return None
        return f"must be in {'(' if low_open else '['}{low:g}, {high:g}]"
    return check


# key -> check(value) returning why the value is refused, or None when it is fine
RULES: dict[str, Callable] = {
    "model": lambda v: None if v.strip() else "must not be empty",
    "quant": lambda v: None if v in QUANT_CHOICES else f"must be one of {', '.join(QUANT_CHOICES)}",
    "accel": lambda v: None if v in ACCEL_CHOICES else f"must be one of {', '.join(ACCEL_CHOICES)}",
    "temperature": _finite(0.0, 2.0),
    "top_p": _finite(0.0, 1.0, low_open=True),
    "top_k": lambda v: None if v >= 0 else "must be 0 or more",
    "max_new_tokens": lambda v: None if 1 <= v <= MAX_NEW_TOKENS else
    f"must be between 1 and {MAX_NEW_TOKENS}",
    "last_conversation": lambda v: None if v == "" or CONVERSATION_ID.fullmatch(v) else
    "is not a conversation id",
}


def problem(key: str, value) -> str | None:
    """Why `value` (already of the right type) cannot be used for `key`; None if it can."""
    rule = RULES.get(key)
    return rule(value) if rule is not None else None
