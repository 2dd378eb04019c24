"""Benchmark prompts: read a prompt file, order it across categories, encode it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.decode.chat_template import conversation, encode, fit_to_context
from engine.errors import QuickdraftError
from engine.paths import ASSETS
from engine.prompt_files import read_prompt_file

DEFAULT_PROMPTS = ASSETS / "bench_prompts.jsonl"
DEFAULT_CATEGORY = "general"  # for prompts whose file gives no category


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of the benchmark."""

    prompt: str  # the user turn the model answers
    category: str  # report group, e.g. "chat", "coding"
    history: tuple[dict, ...] = ()  # earlier {"role", "content"} turns (multi-turn chat)


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """The prompts of a prompt file (engine/prompt_files.py); a line gives one "prompt"
    (with an optional "history"): the benchmark has no answers to put between "turns"."""
    prompts = []
    for n, record in enumerate(read_prompt_file(path, DEFAULT_CATEGORY), 1):
        if len(record.turns) != 1:
            raise QuickdraftError(f'{path}: prompt {n} has several "turns": the benchmark '
                                  'takes one "prompt" (and an optional "history")')
        prompts.append(BenchPrompt(record.turns[0], record.category, record.history))
    return prompts


def round_robin(prompts: list[BenchPrompt], limit: int | None = None) -> list[BenchPrompt]:
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
