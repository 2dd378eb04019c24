"""Training features: conversations -> token ids and assistant masks -> the frozen model's
hidden states, computed once and cached on disk so every epoch reads the cache.

Layer index l selects `output_hidden_states[l]`: 0 is the embeddings, l the output of
decoder layer l, and L (= num_hidden_layers) the final normed state fed to the LM head.
The teacher's next-token distributions are not stored: the LM head is frozen, so they come
back from the cached final states in one matmul.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from engine.decode import timing
from engine.decode.chat_template import render
from engine.errors import QuickdraftError
from engine.paths import atomic_write, cache_dir
from engine.progress import Eta, Progress, ProgressFn, ignore
from trainer.context import fit_sequence, padded

SHARD_TOKENS = 65536  # tokens per cache shard: the unit of resuming
BATCH_TOKENS = 8192  # padded tokens per frozen forward (memory / speed balance on a CPU)


@dataclass
class Features:
    """Concatenated features of many conversations (T tokens in all, C conversations)."""

    ids: torch.Tensor  # (T,) long token ids
    mask: torch.Tensor  # (T,) bool: token is part of a model answer
    offsets: torch.Tensor  # (C + 1,) long: conversation c spans offsets[c]:offsets[c + 1]
    states: dict[int, torch.Tensor]  # layer -> (T, H) hidden states, storage dtype
    # The model's top-k next-token logits where the data stage recorded them (recorded[t]),
    # (T, k) int32 ids and float16 logits; None when no position was recorded.
    top_ids: torch.Tensor | None = None
    top_logits: torch.Tensor | None = None
    recorded: torch.Tensor | None = None  # (T,) bool

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())

    @property
    def conversations(self) -> int:
        return int(self.offsets.numel()) - 1


@dataclass
class FeatureCache:
    """A folder of safetensors shards holding Features for one (model, data, layers)."""

    folder: Path
    layers: list[int]
    shards: list[Path]

    def load(self) -> Features:
        """All shards concatenated in memory."""
        return join([_read_shard(p, self.layers) for p in self.shards])


def offsets(lengths: torch.Tensor) -> torch.Tensor:
    """(C + 1,) long: where each of C conversations of `lengths` tokens starts, then the end."""
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0))


def join(parts: list[Features]) -> Features:
    """The parts' conversations end to end. Where only some parts hold the model's top-k
    logits (recorded while answering), the others' positions get zeros and recorded False."""
    feats = Features(torch.cat([p.ids for p in parts]), torch.cat([p.mask for p in parts]),
                     offsets(torch.cat([p.offsets.diff() for p in parts])),
                     {n: torch.cat([p.states[n] for p in parts]) for n in parts[0].states})
    tops = [p for p in parts if p.top_ids is not None]
    if tops:
        k = tops[0].top_ids.shape[1]

        def filled(p: Features, top: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
            return top if top is not None else torch.zeros(p.tokens, k, dtype=dtype)

        feats.top_ids = torch.cat([filled(p, p.top_ids, torch.int32) for p in parts])
        feats.top_logits = torch.cat([filled(p, p.top_logits, torch.float16) for p in parts])
        feats.recorded = torch.cat([torch.full((p.tokens,), p.top_ids is not None)
                                    for p in parts])
    return feats


def encode_conversations(lm, conversations: list[list[dict]]
                         ) -> tuple[list[list[int]], list[list[bool]]]:
    """Token ids of each whole conversation through the model's chat template, and a mask
    that is True on the tokens of the model's answers (including their end-of-turn token).

    A conversation longer than the model's context keeps its first context_len tokens (one
    forward pass reads it).
    """
    all_ids, all_masks = [], []
    for messages in conversations:
        ids = fit_sequence(lm, render(lm.tokenizer, messages, generation_prompt=False))
        all_ids.append(ids)
        all_masks.append(mark_answers(lm, messages, [False] * len(ids), len(ids)))
    return all_ids, all_masks


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


def conversation_tokens(lm, messages: list[dict]) -> int:
    """Tokens the features stage reads for one conversation (encode_conversations' ids)."""
    return len(fit_sequence(lm, render(lm.tokenizer, messages, generation_prompt=False)))


def hidden_states(lm, ids_batch: list[list[int]], layers: list[int],
                  masks: list[list[bool]] | None = None, progress: ProgressFn = ignore,
                  cancel: threading.Event | None = None) -> FeatureCache:
    """Run the frozen model over every conversation and cache the requested layers.

    Shards are keyed by the model, its quantization, the layers and their tokens, so a rerun
    (or a resumed run after a kill) reuses finished shards. Cancelling stops between shards
    and raises QuickdraftError.
    """
    num_layers = int(lm.model.config.num_hidden_layers)
    layers = sorted({int(layer) for layer in layers})
    if not layers or layers[0] < 0 or layers[-1] > num_layers:
        raise QuickdraftError(f"feature layers must be within 0..{num_layers}, got {layers}")
    masks = masks if masks is not None else [[True] * len(ids) for ids in ids_batch]
    folder = cache_dir() / "features" / lm.fingerprint
    eta = Eta(sum(len(ids) for ids in ids_batch))
    shards, done_tokens = [], 0
    for group in _shard_groups([len(ids) for ids in ids_batch]):
        ids, mask = [ids_batch[i] for i in group], [masks[i] for i in group]
        shards.append(folder / f"{_shard_key(lm, layers, ids, mask)}.safetensors")
        if not _valid(shards[-1]):
            if cancel is not None and cancel.is_set():
                raise QuickdraftError("feature extraction cancelled")
            _write_shard(lm, shards[-1], ids, mask, layers)
        done_tokens += sum(len(seq) for seq in ids)
        progress(Progress("features", done_tokens, eta.total, f"{done_tokens}/{eta.total} tokens",
                          eta.left(done_tokens)))
    return FeatureCache(folder, layers, shards)


def _shard_key(lm, layers: list[int], ids_list, mask_list) -> str:
    """Content hash of a shard: the model, its quantization, the layers and the tokens.

    Shards hold consecutive conversations, so appending data (a resumed or longer run)
    leaves the earlier shards' keys, and their cached files, unchanged."""
    digest = hashlib.sha256(json.dumps([lm.fingerprint, lm.quant, layers]).encode())
    for ids, mask in zip(ids_list, mask_list, strict=True):
        digest.update(json.dumps([ids, [int(m) for m in mask]]).encode())
    return digest.hexdigest()[:20]


def _shard_groups(lengths: list[int]) -> list[list[int]]:
    """Consecutive conversations, about SHARD_TOKENS tokens per shard."""
    groups, current, size = [], [], 0
    for i, n in enumerate(lengths):
        current.append(i)
        size += n
        if size >= SHARD_TOKENS:
            groups.append(current)
            current, size = [], 0
    return groups + ([current] if current else [])


def _valid(path: Path) -> bool:
    if not path.is_file():
        return False
    try:  # the header lists every tensor; a torn file fails its size check on open
        with safe_open(path, framework="pt") as fh:
            return "offsets" in fh.keys()
    except (SafetensorError, OSError, ValueError):
        return False


def _write_shard(lm, path: Path, ids_list, mask_list, layers: list[int]) -> None:
    """Forward the conversations (length-sorted, right-padded batches) and save atomically."""
    states = {layer: [None] * len(ids_list) for layer in layers}
    order = sorted(range(len(ids_list)), key=lambda i: len(ids_list[i]))
    while order:
        width = len(ids_list[order[-1]])
        take = max(1, min(len(order), BATCH_TOKENS // max(1, width)))
        batch, order = order[-take:], order[:-take]
        out = _forward(lm, [ids_list[i] for i in batch])
        for row, i in enumerate(batch):
            for layer in layers:
                states[layer][i] = out[layer][row, : len(ids_list[i])].cpu()
    tensors = {
        "ids": torch.tensor([t for ids in ids_list for t in ids], dtype=torch.long),
        "mask": torch.tensor([bool(m) for mask in mask_list for m in mask], dtype=torch.bool),
        "offsets": offsets(torch.tensor([len(ids) for ids in ids_list])),
    }
    tensors.update({f"layer{n}": torch.cat(states[n]).contiguous() for n in layers})
    atomic_write(path, lambda tmp: save_file(tensors, tmp))


def _forward(lm, batch: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """One frozen forward over right-padded conversations: all layers' (B, width, H) states."""
    ids, attn = padded(batch)
    with torch.inference_mode():
        out = lm.model(input_ids=ids.to(lm.device), attention_mask=attn.to(lm.device),
                       output_hidden_states=True, use_cache=False, logits_to_keep=1)
    return out.hidden_states


def forward_seconds_per_token(lm, rows: int = 4, width: int = 256) -> float:
    """Seconds a frozen feature forward takes per token on this machine: one timed forward
    of rows x width tokens after a short warm-up. The pipeline sizes the data stage with it,
    since every token the data stage writes costs the features stage this much again."""
    width = max(8, min(width, lm.context_len))
    vocab = int(lm.model.get_input_embeddings().num_embeddings)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (rows, width), generator=gen).tolist()
    _forward(lm, [batch[0][:16]])
    return timing.seconds(lm.device, _forward, lm, batch) / (rows * width)


def _read_shard(path: Path, layers: list[int]) -> Features:
    try:
        t = load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise QuickdraftError(f"the feature cache shard {path} is unreadable; delete it and "
                              "rerun") from exc
    return Features(t["ids"], t["mask"], t["offsets"], {n: t[f"layer{n}"] for n in layers})
