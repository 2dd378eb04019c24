"""Prompt files, read one way for the benchmark and for training's seed prompts: JSONL with
one object per line, or plain text with one prompt per line. The file is JSONL when its
first non-blank line is a JSON object; then every line must be one. A line gives its user
turns as "prompt" (one) or "turns" (answered in order), optionally a "category" and a
"history" of earlier {"role", "content"} turns. Every mistake is one line naming the line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import QuickdraftError
from engine.stored_files import read_text

PROMPT_FILE_BYTES = 256 * 2**20  # a larger prompt file is refused

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class PromptRecord:
    """One line of a prompt file."""

    turns: tuple[str, ...]  # user turns, answered in order (one for a "prompt")
    category: str  # report or sampling group, e.g. "chat", "coding"
    history: tuple[dict, ...] = ()  # earlier {"role", "content"} turns (multi-turn chat)


def read_prompt_file(path: str | Path, default_category: str) -> list[PromptRecord]:
    """The records of a prompt file; QuickdraftError (one line) for a file or line that
    cannot be read."""
    path = Path(path)
    try:  # a link the user made is followed; a FIFO or a device is never opened to block
        text = read_text(path, PROMPT_FILE_BYTES, follow_links=True)
    except FileNotFoundError as exc:
        raise QuickdraftError(f"prompt file not found: {path}") from exc
    except ValueError as exc:
        raise QuickdraftError(f"{path} is {exc}") from exc  # "a folder, not a file", ...
    except OSError as exc:
        raise QuickdraftError(f"cannot read the prompt file {path}: {exc.strerror}") from exc
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise QuickdraftError(f"{path} holds no prompts")
    if _is_json_object(lines[0][1]):
        return [_parse_line(f"{path} line {n}", line, default_category) for n, line in lines]
    return [PromptRecord((line,), default_category) for _n, line in lines]


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):
        return False


def _parse_line(where: str, line: str, default_category: str) -> PromptRecord:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise QuickdraftError(f"{where}: not valid JSON ({exc.msg})") from exc
    except (ValueError, RecursionError) as exc:  # a number of thousands of digits, deep nesting
        raise QuickdraftError(f"{where}: not JSON this app reads") from exc
    if not isinstance(row, dict):
        raise QuickdraftError(f'{where}: expected a JSON object with a "prompt" or "turns"')
    turns = row.get("turns", [row.get("prompt")])
    if not isinstance(turns, list) or not turns or not all(
            isinstance(t, str) and t.strip() for t in turns):
        raise QuickdraftError(f'{where}: no "prompt" text (or "turns", a list of texts)')
    category = row.get("category", default_category)
    if not isinstance(category, str) or not category.strip():
        raise QuickdraftError(f'{where}: "category" must be a non-empty string')
    history = row.get("history", [])
    if not isinstance(history, list) or not all(_is_turn(t) for t in history):
        raise QuickdraftError(
            f'{where}: "history" must be a list of {{"role", "content"}} turns '
            f"with role one of {', '.join(ROLES)}"
        )
    return PromptRecord(tuple(turns), category.strip(),
                        tuple({"role": t["role"], "content": t["content"]} for t in history))


def _is_turn(turn) -> bool:
    return (isinstance(turn, dict) and turn.get("role") in ROLES
            and isinstance(turn.get("content"), str))
