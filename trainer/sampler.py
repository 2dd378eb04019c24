"""Batched answer sampling for the data stage, with rows refilled as answers finish.

`generate()` on a batch decodes until its longest answer ends, so rows whose answers are
done keep costing a row each step, and a new batch waits for the slowest answer of the
last. Here a finished row is swapped for the next prompt (continuous batching): rows that
finish are left in place until a quarter of the batch is free, then the new prompts are
prefilled together and joined to the running rows, all left-padded to a shared width
that the attention mask hides. Positions are per row, so each answer sees exactly what it
would see alone.

Only models whose cache layers are all plain full attention can have rows swapped like
this (kv_cache.rows_editable); the data stage answers the others with generate().
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from engine import kv_cache
from trainer.context import padded

# Positions reserved in the cache beyond the current width, so steps append in place.
ROOM = 64
# Share of the free accelerator memory the rows' caches may take (activations, the
# prefill and the LM head's logits need the rest).
KV_SHARE = 0.5
# A prefill group may hold this many padded positions per real one before it is split.
PAD_SLACK = 1.3


@dataclass(frozen=True)
class AnswerJob:
    """One prompt to answer."""

    prompt: list[int]  # token ids, already fitted to the context with room for the answer
    greedy: bool  # argmax instead of sampling
    max_new: int  # answer length cap
    tag: object = None  # the caller's handle, returned with the answer


@dataclass(frozen=True)
class SamplerConfig:
    """How many rows run together and how answers are drawn."""

    batch_size: int  # rows decoded together (the data budget's, memory permitting)
    temperature: float = 0.7  # for rows that sample
    # Refill once this share of the rows is finished: a prefill costs a few steps, so
    # refilling after every finished row would spend more than the idle rows waste.
    refill_fraction: float = 0.25


def rows_that_fit(lm, wanted: int, positions: int) -> int:
    """At most `wanted` rows, fewer where their cache of `positions` each would take more
    than KV_SHARE of the accelerator's free memory (a 7B model's rows are large; on the
    CPU the model's own memory check at load is the limit)."""
    if lm.device.type != "cuda":
        return wanted
    config = lm.model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_row = 2 * config.num_hidden_layers * heads * head_dim * positions * lm.dtype.itemsize
    free, _total = torch.cuda.mem_get_info(lm.device)
    return max(1, min(wanted, int(free * KV_SHARE // per_row)))


def supports_refill(lm) -> bool:
    """Whether this model's cache can have rows swapped (every layer full attention)."""
    return kv_cache.rows_editable(DynamicCache(config=lm.model.config))


@dataclass
class _Rows:
    """The running batch: one entry per row, finished rows included until the next refill."""

    jobs: list[AnswerJob]
    answers: list[list[int]]
    alive: list[bool]
    cache: DynamicCache
    mask: torch.Tensor  # (B, width) 1 where a row has a real position
    pos: torch.Tensor  # (B,) the next position of each row
    last: torch.Tensor  # (B,) the token each row feeds next
    finished: list[int] = field(default_factory=list)  # rows that finished this step


def answers(lm, queue: deque[AnswerJob], config: SamplerConfig, generator: torch.Generator,
            keep_going: Callable[[], bool]) -> Iterator[tuple[AnswerJob, list[int]]]:
    """Answer the jobs in `queue` (the caller may push more between answers), yielding
    (job, answer ids without EOS) as each finishes. Stops when the queue and the batch
    are empty, or as soon as keep_going() says so (unfinished answers are dropped)."""
    rows: _Rows | None = None
    refill_at = max(1, int(config.batch_size * config.refill_fraction))
    while keep_going():
        live = 0 if rows is None else sum(rows.alive)
        idle = 0 if rows is None else len(rows.alive) - live
        if queue and (live == 0 or config.batch_size - live >= refill_at):
            new = [queue.popleft() for _ in range(min(config.batch_size - live, len(queue)))]
            rows = _join(lm, rows, new, config, generator)
        elif live == 0:
            return
        elif not queue and idle >= refill_at:
            rows = _join(lm, rows, [], config, generator)  # the tail: drop finished rows
        else:
            _step(lm, rows, config, generator)
        for r in rows.finished:
            yield rows.jobs[r], rows.answers[r]
        rows.finished = []


def _step(lm, rows: _Rows, config: SamplerConfig, generator: torch.Generator) -> None:
    """One decode step for every row; finished rows decode padding that nobody reads."""
    rows.mask = torch.cat([rows.mask, rows.mask.new_ones(len(rows.jobs), 1)], dim=1)
    with torch.inference_mode():
        out = lm.model(input_ids=rows.last[:, None], attention_mask=rows.mask,
                       position_ids=rows.pos[:, None], past_key_values=rows.cache,
                       use_cache=True)
    # Finished rows keep their position: a model with learned positions must not run
    # past its table on a row nobody reads.
    rows.pos = rows.pos + torch.tensor(rows.alive, device=rows.pos.device)
    _take(lm, rows, out.logits[:, -1], 0, config, generator)


def _take(lm, rows: _Rows, logits: torch.Tensor, first: int, config: SamplerConfig,
          generator: torch.Generator) -> None:
    """Choose the next token of rows first.. from their logits; mark finished rows."""
    greedy = torch.tensor([job.greedy for job in rows.jobs[first:]], device=logits.device)
    tokens = _choose(logits.float(), greedy, config.temperature, generator)
    rows.last[first:] = tokens
    for r, token in enumerate(tokens.tolist(), start=first):
        if not rows.alive[r]:
            continue
        if token in lm.eos_ids:
            rows.alive[r] = False
        else:
            rows.answers[r].append(token)
            rows.alive[r] = len(rows.answers[r]) < rows.jobs[r].max_new
        if not rows.alive[r]:
            rows.finished.append(r)


def _choose(logits: torch.Tensor, greedy: torch.Tensor, temperature: float,
            generator: torch.Generator) -> torch.Tensor:
    """Per row: the argmax, or a draw from softmax(logits / temperature).

    The draw inverts the cumulative distribution at one uniform number per row:
    torch.multinomial draws a random number per vocabulary entry on the CPU, which at 32
    rows x 49k entries cost more than a third of the model's step. The sum runs in float64
    so the smallest probabilities keep their share."""
    top = logits.argmax(-1)
    if bool(greedy.all()) or temperature <= 0:
        return top
    cdf = torch.softmax(logits / temperature, dim=-1).double().cumsum(-1)
    u = torch.rand((logits.shape[0], 1), generator=generator, device=logits.device,
                   dtype=torch.float64) * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    return torch.where(greedy, top, drawn)


def _join(lm, rows: _Rows | None, new: list[AnswerJob], config: SamplerConfig,
          generator: torch.Generator) -> _Rows:
    """The running rows that are still alive followed by the `new` jobs, prefilled."""
    kept = [] if rows is None else [r for r, alive in enumerate(rows.alive) if alive]
    parts, masks, pos, last = [], [], [], []
    width = 0
    if kept:
        keep = torch.tensor(kept, device=lm.device)
        mask = rows.mask[keep]
        width = mask.shape[1] - int(mask.argmax(-1).min())  # from the oldest real column
        parts.append((rows.cache, keep))
        masks.append(mask)
        pos.append(rows.pos[keep])
        last.append(rows.last[keep])
    new = sorted(new, key=lambda job: len(job.prompt))
    logits = []
    for group in _length_groups(new):
        cache, mask, group_logits = _prefill(lm, group)
        width = max(width, mask.shape[1])
        parts.append((cache, torch.arange(len(group), device=lm.device)))
        masks.append(mask)
        pos.append(mask.sum(-1))  # each prompt's length: its answer's first position
        last.append(mask.new_zeros(len(group)))
        logits.append(group_logits)
    joined = _Rows(
        jobs=[rows.jobs[r] for r in kept] + new,
        answers=[rows.answers[r] for r in kept] + [[] for _ in new],
        alive=[True] * (len(kept) + len(new)),
        cache=kv_cache.regroup(lm.model, parts, width, ROOM),
        mask=torch.cat([_left_pad(m, width) for m in masks]),
        pos=torch.cat(pos),
        last=torch.cat(last),
    )
    if new:
        _take(lm, joined, torch.cat(logits), len(kept), config, generator)
    return joined


def _length_groups(jobs: list[AnswerJob]) -> list[list[AnswerJob]]:
    """Length-sorted jobs cut into prefill groups that pad little: a later turn of a long
    conversation would otherwise pad every short new prompt to its length."""
    groups: list[list[AnswerJob]] = []
    for job in jobs:
        group = groups[-1] if groups else None
        if group and len(job.prompt) * (len(group) + 1) <= PAD_SLACK * (
                sum(len(j.prompt) for j in group) + len(job.prompt)):
            group.append(job)
        else:
            groups.append([job])
    return groups


def _prefill(lm, jobs: list[AnswerJob]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """Prompts left-padded together through the model: (cache, mask, last logits)."""
    ids, mask = padded([job.prompt for job in jobs], left=True)
    ids, mask = ids.to(lm.device), mask.to(lm.device)
    cache = DynamicCache(config=lm.model.config)
    with torch.inference_mode():
        out = lm.model(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                       past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, mask, out.logits[:, -1]


def _left_pad(mask: torch.Tensor, width: int) -> torch.Tensor:
    have = mask.shape[1]
    if have >= width:
        return mask[:, have - width:]
    return torch.cat([mask.new_zeros(mask.shape[0], width - have), mask], dim=1)
