"""Features recorded while the data stage answered: the states and top-k logits of every
position of each finished conversation, as the answering forwards computed them
(trainer/sampler.py `Record`), so the features stage never runs the model over them again.

Conversations are found by a digest of their messages; shards of about SHARD_TOKENS tokens
are written as they fill (atomically), so a killed run keeps every shard written before it
and the conversations it had not flushed are read by the features stage instead.
features_for gives the trainers a split's features: the recorded ones from here, the rest
from the frozen model's cached forwards (trainer/features.py).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from engine.errors import QuickdraftError
from engine.paths import atomic_write, cache_dir
from engine.progress import Progress, ProgressFn, ignore
from trainer.features import Features, encode_conversations, hidden_states, join, mark_answers

SHARD_TOKENS = 65536  # tokens per shard: what a kill can lose


def digest(messages: list[dict]) -> str:
    """The key a conversation's recorded features are found by."""
    text = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def folder(lm) -> Path:
    """Where this model's recorded features live (per quantization: the states are the ones
    the data was answered with)."""
    return cache_dir() / "features" / lm.fingerprint / "recorded" / lm.quant


def answer_mask(lm, messages: list[dict], prompt_len: int, total: int) -> list[bool]:
    """True on the answers' positions of a conversation recorded as its last turn's prompt
    (prompt_len tokens, the earlier turns inside it as the chat template renders them)
    followed by its last answer (the end of turn included), `total` positions in all."""
    mask = [False] * prompt_len + [True] * (total - prompt_len)
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return mark_answers(lm, messages[:last], mask, prompt_len)


@dataclass
class Writer:
    """Appends recorded conversations to shards under `folder`."""

    folder: Path
    pending: list[tuple[str, Features]] = field(default_factory=list)

    def add(self, key: str, conv: Features) -> None:
        self.pending.append((key, conv))
        if sum(c.tokens for _k, c in self.pending) >= SHARD_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        keys, convs = zip(*self.pending, strict=True)
        j = join(list(convs))
        tensors = {"ids": j.ids, "mask": j.mask, "offsets": j.offsets, "top_ids": j.top_ids,
                   "top_logits": j.top_logits, **{f"layer{n}": t for n, t in j.states.items()}}
        name = hashlib.sha1("".join(keys).encode()).hexdigest()[:20]
        meta = {"keys": json.dumps(keys)}
        atomic_write(self.folder / f"{name}.safetensors",
                     lambda tmp: save_file(tensors, tmp, metadata=meta))
        self.pending = []


def read(folder: Path, wanted: set[str], layers: list[int]) -> dict[str, Features]:
    """The recorded conversations of `folder` whose keys are in `wanted`, with the states
    of `layers` (a shard without them, or unreadable, is skipped: its conversations are
    read by the features stage instead)."""
    found: dict[str, Features] = {}
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
            found[key] = Features(t["ids"][a:b], t["mask"][a:b], torch.tensor([0, b - a]),
                                  {n: t[f"layer{n}"][a:b] for n in layers},
                                  t["top_ids"][a:b], t["top_logits"][a:b])
    return found


def features_for(lm, convs: list[list[dict]], layers: list[int], progress: ProgressFn = ignore,
                 cancel: threading.Event | None = None) -> Features:
    """The conversations' token ids, answer masks and hidden states at `layers`: as the data
    stage recorded them where it did (with the model's top-k logits), else from a frozen
    forward (cached)."""
    keys = [digest(conv) for conv in convs]
    found = read(folder(lm), set(keys), layers)
    if found:
        tokens = sum(c.tokens for c in found.values())
        progress(Progress("features", tokens, tokens,
                          f"{tokens} tokens recorded while answering", 0.0))
    if cancel is not None and cancel.is_set():
        raise QuickdraftError("feature extraction cancelled")
    rest = [conv for conv, key in zip(convs, keys, strict=True) if key not in found]
    if rest:
        ids, masks = encode_conversations(lm, rest)
        computed = hidden_states(lm, ids, layers, masks, progress, cancel).load()
    parts, c = [], 0  # in conversation order
    for key in keys:
        if key in found:
            parts.append(found[key])
            continue
        a, b = int(computed.offsets[c]), int(computed.offsets[c + 1])
        c += 1
        parts.append(Features(computed.ids[a:b], computed.mask[a:b], torch.tensor([0, b - a]),
                              {n: computed.states[n][a:b] for n in layers}))
    if not parts:
        raise QuickdraftError("no conversations to read features from")
    return join(parts)
