"""Batched answer sampling for the data stage, with rows refilled as answers finish, on the
lean step's batched rows (engine/lean/batch.py).

`generate()` on a batch decodes until its longest answer ends, so rows whose answers are
done keep costing a row each step, and a new batch waits for the slowest answer of the
last. Here every row has its own cache and length: a finished row takes the next prompt at
once (continuous batching), prefilled alone into that row while the others wait one
prefill. Each answer is exactly what the prompt would get alone.

An answer can come with its features: the states of chosen layers and the model's top-k
next-token logits at every position of prompt + answer, computed by the same forwards that
wrote it (`Record`), so the trainer never runs the model over its data a second time. An
answer that ended with the end-of-turn token has it fed once more, so every position,
that one included, has its states.

Models the lean step does not cover are answered by the data stage with generate().
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from engine.decode.sampling import draw
from engine.lean.batch import BatchRows, Step
from engine.lean.lean_target import LeanTarget

# Share of the free accelerator memory the rows' caches may take (activations, the
# prefill and the LM head's logits need the rest).
KV_SHARE = 0.5


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


@dataclass(frozen=True)
class Record:
    """What to keep of every position an answer's forwards computed."""

    layers: tuple[int, ...]  # hidden-state layers (0: embeddings; L: final normed state)
    topk: int = 16  # the model's top-k next-token logits kept per position


@dataclass
class Features:
    """One answered prompt's features: prompt + answer (+ the end-of-turn token)."""

    ids: list[int]  # every position's token
    states: dict[int, torch.Tensor]  # layer -> (T, H) bf16
    top_ids: torch.Tensor  # (T, k) int32: the model's top-k next tokens after each position
    top_logits: torch.Tensor  # (T, k) float16, same order


@dataclass
class Answer:
    """A finished answer: its tokens (end-of-turn cut) and, when recorded, its features."""

    ids: list[int]
    features: Features | None = None


def supports_rows(lm) -> bool:
    """Whether this model's answers can be batched row by row (the lean step runs it)."""
    return isinstance(lm.target, LeanTarget)


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


@dataclass
class _Row:
    """One row's answer in progress, with what it records."""

    job: AnswerJob
    answer: list[int] = field(default_factory=list)
    ended: bool = False  # its last token is the end of turn
    closing: bool = False  # its last token is chosen: fed once more for its states, then done
    states: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    top_ids: list[torch.Tensor] = field(default_factory=list)
    top_logits: list[torch.Tensor] = field(default_factory=list)

    def keep(self, step: Step, at, record: Record | None) -> None:
        """Record the step's rows `at` (an index or a slice) for this answer."""
        if record is None:
            return
        for layer in record.layers:
            self.states.setdefault(layer, []).append(step.states[layer][at].to(torch.bfloat16))
        top = step.logits[at].topk(record.topk, dim=-1)
        self.top_ids.append(top.indices.to(torch.int32))
        self.top_logits.append(top.values.to(torch.float16))

    def result(self, record: Record | None) -> Answer:
        """The answer (end of turn cut) and, when recorded, the features of every position
        (the end of turn's included)."""
        answer = self.answer[:-1] if self.ended else self.answer
        if record is None:
            return Answer(answer)

        def joined(parts):
            return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]).cpu()

        ids = [*self.job.prompt, *self.answer]
        return Answer(answer, Features(ids, {n: joined(p) for n, p in self.states.items()},
                                       joined(self.top_ids), joined(self.top_logits)))


def answers(lm, queue: deque[AnswerJob], config: SamplerConfig, generator: torch.Generator,
            keep_going: Callable[[], bool], record: Record | None = None
            ) -> Iterator[tuple[AnswerJob, Answer]]:
    """Answer the jobs in `queue` (the caller may push more between answers), yielding
    (job, answer) as each finishes. Stops when the queue and the rows are empty, or as
    soon as keep_going() says so (unfinished answers are dropped)."""
    longest = max((len(j.prompt) + j.max_new for j in queue), default=1)
    rows = BatchRows(lm.target, config.batch_size, longest + 2)
    live: list[_Row | None] = [None] * config.batch_size
    pending = torch.zeros(config.batch_size, dtype=torch.long)
    layers = record.layers if record else ()
    while keep_going():
        for r in range(config.batch_size):  # refill: every free row takes the next job
            while live[r] is None and queue:
                row = _start(lm, rows, r, queue.popleft(), pending, config, generator, record)
                if _done(lm, row, int(pending[r]), record):
                    yield row.job, row.result(record)  # ended at its first token
                else:
                    live[r] = row
        if not any(live):
            return
        active = torch.tensor([row is not None for row in live])
        step = rows.step(pending, active, layers)
        greedy = torch.tensor([row is None or row.job.greedy for row in live],
                              device=step.logits.device)
        pending = _choose(step.logits, greedy, config.temperature, generator).cpu()
        for r, row in enumerate(live):
            if row is None:
                continue
            row.keep(step, r, record)
            if row.closing or _done(lm, row, int(pending[r]), record):
                live[r] = None
                yield row.job, row.result(record)


def _start(lm, rows: BatchRows, r: int, job: AnswerJob, pending: torch.Tensor,
           config: SamplerConfig, generator: torch.Generator, record: Record | None) -> _Row:
    """Prefill `job` into row r and choose its first token."""
    rows.reserve(len(job.prompt) + job.max_new + 2)
    step = rows.prefill(r, job.prompt, record.layers if record else ())
    row = _Row(job)
    row.keep(step, slice(None), record)
    greedy = torch.tensor([job.greedy], device=step.logits.device)
    pending[r] = _choose(step.logits[-1:], greedy, config.temperature, generator)[0].cpu()
    return row


def _done(lm, row: _Row, token: int, record: Record | None) -> bool:
    """Add the row's chosen token; True when the answer is done. A recorded answer that
    just ended closes instead: its last token is fed once more for its states."""
    row.answer.append(token)
    row.ended = token in lm.eos_ids
    if not row.ended and len(row.answer) < row.job.max_new:
        return False
    row.closing = record is not None
    return not row.closing


def _choose(logits: torch.Tensor, greedy: torch.Tensor, temperature: float,
            generator: torch.Generator) -> torch.Tensor:
    """Per row: the argmax, or a draw from softmax(logits / temperature) (one uniform
    number per row: engine.decode.sampling.draw)."""
    top = logits.argmax(-1)
    if bool(greedy.all()) or temperature <= 0:
        return top
    drawn = draw(torch.softmax(logits / temperature, dim=-1), generator).squeeze(-1)
    return torch.where(greedy, top, drawn)
