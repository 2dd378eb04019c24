"""Fitting the trainer's sequences to the model's context window.

Models with learned absolute positions (GPT-2, OPT) raise IndexError past their last
position, and a short window leaves little room: every prompt, answer and timing context the
trainer builds is cut to fit `lm.context_len` here.
"""

from __future__ import annotations

from engine.chat import conversation, encode, fit_to_context


def prompt_ids(lm, conv: list[dict]) -> list[int]:
    """The first user turn of a held-out conversation, as the app would prompt it."""
    return encode(lm.tokenizer, conversation(conv[0]["content"]))


def answer_room(lm, wanted: int) -> int:
    """Tokens an answer may take: `wanted`, but at most half the context, so a prompt keeps
    the other half."""
    return max(1, min(wanted, lm.context_len // 2))


def fit_prompt(lm, ids: list[int], answer_tokens: int) -> list[int]:
    """The prompt's most recent tokens that leave `answer_tokens` positions for the answer."""
    return fit_to_context(list(ids), lm.context_len, answer_tokens)[0]


def fit_sequence(lm, ids: list, extra: int = 0) -> list:
    """The first tokens of a whole sequence (a conversation read in one forward pass) that
    leave `extra` positions after them."""
    return ids[: max(1, lm.context_len - extra)]
