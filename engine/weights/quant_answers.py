"""The answers half of `--quant auto`'s quality gate (engine/weights/quant_auto.py): held-out
questions with checkable answers, answered greedily by the reference weights and by each
candidate, at the least cost that decides each answer.

- A reply stops once it is decided: a right answer followed by anything, or the end of the
  reply (EOS or REPLY_TOKENS). A right answer needs no more words.
- A candidate first reads the reference's replies in one batched forward (teacher forcing):
  where its own greedy choice is the reference's token at every position, its reply IS the
  reference's (right or wrong alike) and nothing is generated. Only the rows where it
  departs from the reference are answered anew.
"""

from __future__ import annotations

import json
import re

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from engine.paths import ASSETS

QUESTIONS = ASSETS / "heldout_questions.jsonl"
REPLY_TOKENS = 32  # greedy tokens per question, at most


def questions() -> list[dict]:
    lines = QUESTIONS.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _matches(reply: str, answers: list[str]):
    text = reply.lower()
    for a in answers:
        yield from re.finditer(rf"(?<![a-z0-9]){re.escape(a.lower())}(?![a-z0-9])", text)


def is_right(reply: str, answers: list[str]) -> bool:
    """Some accepted answer appears in the reply as a word of its own ("4" not in "14")."""
    return any(True for _ in _matches(reply, answers))


def settled_right(reply: str, answers: list[str]) -> bool:
    """Right whatever follows: an answer with at least one character after it (a "4" that
    ends the text could still become "42")."""
    return any(m.end() < len(reply) for m in _matches(reply, answers))


def prompts_that_fit(tokenizer, asked: list[dict], window: int) -> list[tuple[list[int], list]]:
    """(prompt ids, answers) of the questions whose prompt and reply fit the model's window."""
    from engine.decode.chat_template import conversation, encode

    fitting = []
    for q in asked:
        ids = encode(tokenizer, conversation(q["prompt"]))
        if len(ids) + REPLY_TOKENS <= window:
            fitting.append((ids, q["answers"]))
    return fitting


class Decided(StoppingCriteria):
    """generate()'s per-row stop: EOS, or a right answer settled. Remembers where each row
    stopped (`ends`), so the padding after it is never read as reply."""

    def __init__(self, tokenizer, width: int, answers: list[list[str]], eos: set[int]):
        self.tokenizer, self.width, self.answers, self.eos = tokenizer, width, answers, eos
        self.ends: list[int | None] = [None] * len(answers)

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        done = []
        for i, row in enumerate(input_ids[:, self.width:].tolist()):
            if self.ends[i] is None and (
                    row[-1] in self.eos
                    or settled_right(self.tokenizer.decode(row), self.answers[i])):
                self.ends[i] = len(row)
            done.append(self.ends[i] is not None)
        return torch.tensor(done, device=input_ids.device)


def replies(model, tokenizer, prompts: list[list[int]], answers: list[list[str]],
            eos: set[int]) -> list[list[int]]:
    """Greedy replies (token ids; an EOS that ended one is kept, last) to each prompt, in
    one left-padded batch, each stopped once decided."""
    if not prompts:
        return []
    ids, mask = _left_padded(tokenizer, prompts)
    stop = Decided(tokenizer, ids.shape[1], answers, eos)
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=REPLY_TOKENS, do_sample=False,
                             pad_token_id=_pad(tokenizer), temperature=None, top_p=None,
                             top_k=None, stopping_criteria=StoppingCriteriaList([stop]))
    rows = out[:, ids.shape[1]:].tolist()
    return [row[:end] if end is not None else row for row, end in zip(rows, stop.ends,
                                                                      strict=True)]


def follows(model, tokenizer, prompts: list[list[int]], given: list[list[int]]) -> list[bool]:
    """Per row: whether `model`'s greedy choice after the prompt and every prefix of the
    given reply is the reply's next token (then its own greedy reply would be that reply)."""
    if not prompts:
        return []
    rows = [p + r for p, r in zip(prompts, given, strict=True)]
    ids, mask = _left_padded(tokenizer, rows)
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    choice = logits.argmax(-1).cpu()  # (rows, width): the token chosen after each position
    width = ids.shape[1]
    # a reply's first token is the choice at width - len(reply) - 1
    return [choice[i, width - len(reply) - 1:width - 1].tolist() == reply
            for i, reply in enumerate(given)]


def answer(model, tokenizer, prompts, answers, eos: set[int],
           reference: list[list[int]] | None) -> tuple[list[list[int]], list[bool]]:
    """(replies, which equal the reference's): `model`'s greedy replies, read off the
    reference's where it follows them, generated where it departs (or with no reference)."""
    if reference is None:
        got = replies(model, tokenizer, prompts, answers, eos)
        return got, [True] * len(got)
    same = follows(model, tokenizer, prompts, reference)
    redo = [i for i, s in enumerate(same) if not s]
    fresh = replies(model, tokenizer, [prompts[i] for i in redo], [answers[i] for i in redo],
                    eos)
    got = list(reference)
    for i, reply in zip(redo, fresh, strict=True):
        got[i] = reply
    return got, [s or got[i] == reference[i] for i, s in enumerate(same)]


def _pad(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _left_padded(tokenizer, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width, pad = max(len(r) for r in rows), _pad(tokenizer)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask
