"""Benchmark prompts: parse a prompt file, order it across categories, encode it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.chat import conversation, encode, fit_to_context
from engine.errors import QuickdraftError

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "assets" / "bench_prompts.jsonl"
DEFAULT_CATEGORY = "general"  # for prompts whose file gives no category
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of the benchmark."""

    prompt: str  # the user turn the model answers
    category: str  # report group, e.g. "chat", "coding"
    history: tuple[dict, ...] = ()  # earlier {"role", "content"} turns (multi-turn chat)


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read a prompt file: JSONL objects with "prompt" (and optional "category", "history"),
    or plain text with one prompt per line. The file is JSONL when its first non-blank line
    is a JSON object; then every line must be one."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise QuickdraftError(f"prompt file not found: {path}") from exc
    except IsADirectoryError as exc:
        raise QuickdraftError(f"{path} is a folder, not a prompt file") from exc
    except UnicodeDecodeError as exc:
        raise QuickdraftError(f"{path} is not UTF-8 text") from exc
    except OSError as exc:
        raise QuickdraftError(f"cannot read {path}: {exc.strerror}") from exc
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise QuickdraftError(f"{path} holds no prompts")
    if _is_json_object(lines[0][1]):
        return [_parse_json_line(path, n, line) for n, line in lines]
    return [BenchPrompt(line, DEFAULT_CATEGORY) for _n, line in lines]


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _parse_json_line(path: Path, n: int, line: str) -> BenchPrompt:
    where = f"{path} line {n}"
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise QuickdraftError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise QuickdraftError(f"{where}: expected a JSON object with a \"prompt\"")
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise QuickdraftError(f"{where}: no \"prompt\" text")
    category = row.get("category", DEFAULT_CATEGORY)
    if not isinstance(category, str) or not category.strip():
        raise QuickdraftError(f"{where}: \"category\" must be a non-empty string")
    history = row.get("history", [])
    if not isinstance(history, list) or not all(_is_turn(t) for t in history):
        raise QuickdraftError(
            f"{where}: \"history\" must be a list of {{\"role\", \"content\"}} turns "
            f"with role one of {', '.join(ROLES)}"
        )
    turns = tuple({"role": t["role"], "content": t["content"]} for t in history)
    return BenchPrompt(prompt, category.strip(), turns)


def _is_turn(turn) -> bool:
    return (isinstance(turn, dict) and turn.get("role") in ROLES
            and isinstance(turn.get("content"), str))


def interleave(prompts: list[BenchPrompt], limit: int | None = None) -> list[BenchPrompt]:
    """Round-robin over categories (in order of first appearance), cut to `limit`.

    Running categories interleaved keeps machine drift from landing on one category, and
    `limit` then takes prompts evenly from every category.
    """
    if limit is not None and limit < 1:
        raise QuickdraftError("--limit must be at least 1")
    groups: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    ordered: list[BenchPrompt] = []
    for i in range(max(len(g) for g in groups.values())):
        ordered += [g[i] for g in groups.values() if i < len(g)]
    return ordered[:limit] if limit is not None else ordered


def encode_prompt(lm, prompt: BenchPrompt, max_new_tokens: int) -> list[int]:
    """Token ids every method receives: the chat template, fitted to the context window."""
    ids = encode(lm.tokenizer, conversation(prompt.prompt, list(prompt.history)))
    ids, _dropped = fit_to_context(ids, lm.context_len, max_new_tokens)
    return ids
