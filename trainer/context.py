"""Fitting the trainer's sequences to the model's context window, and padding them into
batches.

Models with learned absolute positions (GPT-2, OPT) raise IndexError past their last
position, and a short window leaves little room: every prompt, answer and timing context the
trainer builds is cut to fit `lm.context_len` here.
"""

from __future__ import annotations

import torch

from engine.decode.chat_template import conversation, encode, fit_to_context


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


def fit_sequence(lm, ids: list) -> list:
    """The first tokens of a whole sequence (a conversation read in one forward pass) that
    fit the context window."""
    return ids[: max(1, lm.context_len)]


def padded(seqs: list[list[int]], value: int = 0, left: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, width) long ids of `seqs` padded with `value` to the longest (on the right, or on
    the left for prompts a batch continues together), and the (B, width) attention mask."""
    width = max(len(seq) for seq in seqs)
    ids = torch.full((len(seqs), width), value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        cols = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[row, cols] = torch.tensor(seq, dtype=torch.long)
        mask[row, cols] = 1
    return ids, mask
