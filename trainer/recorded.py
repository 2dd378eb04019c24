"""Features recorded while the data stage answered: the states and top-k logits of every
position of each finished conversation, as the answering forwards computed them
(trainer/sampler.py `Record`), so the features stage never runs the model over them again.

Conversations are found by a digest of their messages; shards of about SHARD_TOKENS tokens
are written as they fill (atomically), so a killed run keeps every shard written before it
and the conversations it had not flushed are read by the features stage instead.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.decode.chat_template import render
from engine.paths import atomic_write, cache_dir

SHARD_TOKENS = 65536  # tokens per shard: what a kill can lose


def digest(messages: list[dict]) -> str:
    """The key a conversation's recorded features are found by."""
    text = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def folder(lm) -> Path:
    """Where this model's recorded features live (per quantization: the states are the ones
    the data was answered with)."""
    return cache_dir() / "features" / lm.fingerprint / "recorded" / lm.quant


def offsets(lengths: torch.Tensor) -> torch.Tensor:
    """(C + 1,) long: where each of C conversations of `lengths` tokens starts, then the end
    (conversation c spans offsets[c]:offsets[c + 1] of the joined tokens)."""
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0))


def answer_mask(lm, messages: list[dict], prompt_len: int, total: int) -> list[bool]:
    """True on the answers' positions of a conversation recorded as its last turn's prompt
    (prompt_len tokens, the earlier turns inside it as the chat template renders them)
    followed by its last answer (the end of turn included), `total` positions in all."""
    mask = [False] * prompt_len + [True] * (total - prompt_len)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return mark_answers(lm, messages[:last], mask, prompt_len)


def mark_answers(lm, messages: list[dict], mask: list[bool], end: int) -> list[bool]:
    """`mask` set True on the positions (before `end`) of every answer in `messages`, its
    end-of-turn token included. The spans come from encoding each prefix up to an answer's
    start and end: chat templates render a prefix of a conversation as a prefix of its tokens."""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(render(lm.tokenizer, messages[:i], generation_prompt=True))
            stop = len(render(lm.tokenizer, messages[: i + 1], generation_prompt=False))
            for j in range(start, min(stop, end)):
                mask[j] = True
    return mask


@dataclass
class Conversation:
    """One conversation's recorded features."""

    ids: torch.Tensor  # (T,) long
    mask: torch.Tensor  # (T,) bool: answer positions
    states: dict[int, torch.Tensor]  # layer -> (T, H) bf16
    top_ids: torch.Tensor  # (T, k) int32: the model's top-k next tokens after each position
    top_logits: torch.Tensor  # (T, k) float16


@dataclass
class Writer:
    """Appends recorded conversations to shards under `folder`."""

    folder: Path
    pending: list[tuple[str, Conversation]] = field(default_factory=list)

    def add(self, key: str, conv: Conversation) -> None:
        self.pending.append((key, conv))
        if sum(c.ids.numel() for _k, c in self.pending) >= SHARD_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        keys, convs = zip(*self.pending, strict=True)
        tensors = {
            "ids": torch.cat([c.ids for c in convs]),
            "mask": torch.cat([c.mask for c in convs]),
            "offsets": offsets(torch.tensor([c.ids.numel() for c in convs])),
            "top_ids": torch.cat([c.top_ids for c in convs]),
            "top_logits": torch.cat([c.top_logits for c in convs]),
        }
        for layer in convs[0].states:
            tensors[f"layer{layer}"] = torch.cat([c.states[layer] for c in convs])
        name = hashlib.sha1("".join(keys).encode()).hexdigest()[:20]
        meta = {"keys": json.dumps(keys)}
        atomic_write(self.folder / f"{name}.safetensors",
                     lambda tmp: save_file(tensors, tmp, metadata=meta))
        self.pending = []


def read(folder: Path, wanted: set[str], layers: list[int]) -> dict[str, Conversation]:
    """The recorded conversations of `folder` whose keys are in `wanted`, with the states
    of `layers` (a shard without them, or unreadable, is skipped: its conversations are
    read by the features stage instead)."""
    found: dict[str, Conversation] = {}
    names = ["ids", "mask", "offsets", "top_ids", "top_logits", *(f"layer{n}" for n in layers)]
    for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            with safe_open(path, framework="pt") as fh:
                keys = json.loads((fh.metadata() or {}).get("keys", "[]"))
                if not wanted.intersection(keys) or not set(names) <= set(fh.keys()):
                    continue
                t = {name: fh.get_tensor(name) for name in names}
        except (SafetensorError, OSError, ValueError):
            continue
        for c, key in enumerate(keys):
            if key not in wanted or key in found:
                continue
            a, b = int(t["offsets"][c]), int(t["offsets"][c + 1])
            found[key] = Conversation(t["ids"][a:b], t["mask"][a:b],
                                      {n: t[f"layer{n}"][a:b] for n in layers},
                                      t["top_ids"][a:b], t["top_logits"][a:b])
    return found
