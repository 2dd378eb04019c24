"""What each setting may hold, wherever it enters: settings.json (the app's own file, but
people edit it and older versions wrote it: a wrong value must cost only that setting, its
default with one line naming the file and the key, never the start-up) and the page's events
(any client can send any JSON: a wrong value is refused in one line, never saved and never
passed on to the engine)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from engine.config import QUANT_CHOICES
from engine.drafters.registry import ACCEL_CHOICES
from engine.errors import QuickdraftError

MAX_NEW_TOKENS = 32_768  # the longest reply the page's slider could ask for, with headroom
# The longest system prompt kept (about 25k tokens): each conversation stores its own copy.
SYSTEM_CHARS = 100_000
CONVERSATION_ID = re.compile(r"[0-9a-f]{1,32}")  # conversation ids, which name their files
# The acceptance rules the page offers: lossless ("auto") and Medusa's typical acceptance.
PAGE_ACCEPTANCE = ("auto", "typical")
# What the page calls each number it sends (for its one-line refusals).
LABELS = {"temperature": "temperature", "top_p": "top-p", "top_k": "top-k",
          "max_new_tokens": "max new tokens", "train_minutes": "the time budget"}


class SettingError(QuickdraftError):
    """A value a page event or the settings file holds that the setting cannot take."""


def _finite(low: float, high: float) -> Callable[[float], str | None]:
    def check(value: float) -> str | None:
        if math.isfinite(value) and low <= value <= high:
            return None
        return f"must be in [{low:g}, {high:g}]"
    return check


def _temperature(value: float) -> str | None:
    """0 is greedy; a temperature below 0.01 divides the logits into overflow, and samples
    as greedy anyway."""
    if value == 0 or _finite(0.01, 2.0)(value) is None:
        return None
    return "must be 0 (greedy) or in [0.01, 2]"


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str | None]:
    return lambda v: None if v in choices else f"must be one of {', '.join(choices)}"


# key -> check(value) returning why the value is refused, or None when it is fine
RULES: dict[str, Callable] = {
    "model": lambda v: None if v.strip() else "must not be empty",
    "quant": _one_of(QUANT_CHOICES),
    "accel": _one_of(ACCEL_CHOICES),
    "acceptance": _one_of(PAGE_ACCEPTANCE),
    "temperature": _temperature,
    # below 0.01 nothing differs from keeping the top token, and tiny masses overflow
    "top_p": _finite(0.01, 1.0),
    "top_k": lambda v: None if v >= 0 else "must be 0 or more",
    "max_new_tokens": lambda v: None if 1 <= v <= MAX_NEW_TOKENS else
    f"must be between 1 and {MAX_NEW_TOKENS}",
    "last_conversation": lambda v: None if v == "" or CONVERSATION_ID.fullmatch(v) else
    "is not a conversation id",
    "system": lambda v: system_problem(v),
    "train_minutes": _finite(1.0, 24 * 60.0),  # a training run's time budget (page only)
}


def refuse(name: str, why: str | None, error: type[QuickdraftError] = SettingError) -> None:
    """Raise `error` saying "`name` `why`" where there is a `why` (a rule refused a value)."""
    if why is not None:
        raise error(f"{name} {why}")


def problem(key: str, value) -> str | None:
    """Why `value` (already of the right type) cannot be used for `key`; None if it can."""
    rule = RULES.get(key)
    return rule(value) if rule is not None else None


def text_problem(text: str) -> str | None:
    """Why `text` cannot be stored or tokenized (a lone surrogate, which no UTF-8 file or
    tokenizer takes); None when it can."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a character that is not valid text (a lone surrogate)"
    return None


def system_problem(text: str) -> str | None:
    """Why `text` cannot be a system prompt (not storable, or longer than SYSTEM_CHARS)."""
    if len(text) > SYSTEM_CHARS:
        return f"is longer than {SYSTEM_CHARS:,} characters"
    return text_problem(text)


def page_number(key: str, value, integer: bool = False) -> float | int:
    """A number a page event sent for setting `key`, checked like the settings file's."""
    name = LABELS.get(key, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SettingError(f"{name} must be a finite number")
    if integer:
        if value != int(value):
            raise SettingError(f"{name} must be a whole number")
        value = int(value)
    refuse(name, problem(key, value))
    return value


def page_text(name: str, value, limit: int | None = None) -> str:
    """Text a page event sent (None: empty), checked to be storable and tokenizable."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise SettingError(f"{name} must be text")
    refuse(name, text_problem(value))
    if limit is not None and len(value) > limit:
        raise SettingError(f"{name} is longer than {limit:,} characters")
    return value


def page_choice(name: str, value, choices: tuple[str, ...]) -> str:
    """One of `choices` from a page event."""
    if not isinstance(value, str) or value not in choices:
        raise SettingError(f"{name} must be one of {', '.join(choices)}")
    return value
