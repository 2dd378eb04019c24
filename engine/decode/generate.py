"""THE decode loop: prefill -> propose -> verify -> accept -> yield an event.

Plain decoding and every drafter share this loop; drafters only differ in what they
propose, how the target scores a draft (Kangaroo skips the shallow layers) and what they
keep afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.config import SamplingParams
from engine.decode import verify
from engine.decode.chat_template import fit_to_context
from engine.decode.drafter import DecodeState, Draft, Drafter, Session, start_session
from engine.decode.grammar import Grammar
from engine.decode.loaded import LoadedModel
from engine.decode.logit_rules import LogitRules
from engine.decode.sampling import (
    greedy_ids,
    logits_to_probs,
    make_generator,
    next_token,
    top_logprobs,
)
from engine.decode.stats import GenerationStats
from engine.decode.target import Forward
from engine.decode.textstream import TextStream
from engine.errors import PromptError

# Prompt tokens per prefill forward: a cancel (Stop, a client that hung up) is seen between
# chunks, so a long prompt stops within one chunk's time instead of the whole prompt's.
PREFILL_CHUNK = 512


@dataclass
class StepEvent:
    """One chunk of the reply: what the UI streams and the CLI prints."""

    text: str  # new, final text (whole characters, no partial stop string)
    token_ids: list[int]  # the new tokens
    accepted: int  # draft tokens accepted in this step (0 for plain decoding)
    tokens: int  # tokens generated so far
    elapsed_s: float  # since the generation started
    done: bool = False
    stats: GenerationStats | None = None  # on the last event
    full_text: str = ""  # the whole reply so far
    notices: list[str] = field(default_factory=list)  # e.g. prompt truncation
    # per new token, when params.logprobs asks: (its log-probability, [(token id, log-prob)
    # of the likeliest tokens]) under the shaped distribution it was chosen from
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


def generate(
    lm: LoadedModel,
    prompt_ids: list[int],
    params: SamplingParams,
    drafter: Drafter | None = None,
    cancel: threading.Event | None = None,
    grammar: Grammar | None = None,
) -> Iterator[StepEvent]:
    """Stream a reply to `prompt_ids`. The last event has done=True and the stats.
    `grammar`: what the reply must match (engine/decode/grammar.py), applied as a mask at every
    position, as params' bias and penalties are (engine/decode/logit_rules.py).

    Greedy decoding with any drafter yields exactly the tokens of plain greedy decoding;
    sampling with the lossless acceptance rules yields the same distribution (both under
    the reply's grammar, bias and penalties).
    """
    if not prompt_ids:
        raise PromptError("the prompt is empty")
    drafter = drafter or Drafter()
    ids, dropped = fit_to_context(list(prompt_ids), lm.context_len, params.max_new_tokens)
    stats = GenerationStats(prompt_tokens=len(ids), prompt_dropped=dropped)
    notices = [f"prompt too long: its first {dropped} tokens were dropped"] if dropped else []
    stream = TextStream(lm.tokenizer, params.stop)
    ends = Ends(lm.eos_ids, params.max_new_tokens, stream)
    start = time.perf_counter()
    prefilled = _prefill(lm, ids, params, drafter, grammar, cancel)
    stats.ttft_s = time.perf_counter() - start
    if prefilled is None:  # cancelled while reading the prompt: nothing was generated
        stats.stop_reason, stats.elapsed_s, stats.step = "cancelled", stats.ttft_s, lm.target.name
        yield StepEvent("", [], 0, 0, stats.elapsed_s, True, stats, "", notices)
        return
    state, session, logprobs = prefilled
    new = [state.ids[-1]]
    reason = ends.emitted(new, 0)[1]
    while True:
        stats.tokens += len(new)
        stats.stop_reason = reason
        text = stream.push(new)
        if not reason and cancel is not None and cancel.is_set():
            stats.stop_reason = "cancelled"
        elapsed = time.perf_counter() - start
        if stats.stop_reason:
            stats.elapsed_s = elapsed
            stats.step = lm.target.name
            session.finish(stats)
            lm.target.release(state.cache)
            text += stream.flush()
            yield StepEvent(text, new, _last(stats), stats.tokens, elapsed, True, stats,
                            stream.emitted, notices, logprobs)
            return
        yield StepEvent(text, new, _last(stats), stats.tokens, elapsed,
                        full_text=stream.emitted, notices=notices, logprobs=logprobs)
        notices = []
        new, reason, accepted, drafted, logprobs = _step(state, session, ends, stats.tokens)
        stats.steps += 1
        stats.accepted.append(accepted)
        stats.drafted.append(drafted)


def _prefill(lm: LoadedModel, ids: list[int], params: SamplingParams, drafter: Drafter,
             grammar: Grammar | None, cancel: threading.Event | None = None
             ) -> tuple[DecodeState, Session, list | None] | None:
    """Run the prompt, choose the first token, and start the drafter's session:
    (state, session, the first token's logprobs when asked); None when `cancel` was set
    between two of the prompt's chunks."""
    generator = make_generator(params.seed, lm.device)
    target = lm.target
    cache = target.new_cache()
    rules = LogitRules.start(lm, params, grammar)
    if drafter.drafts:
        target.check_draftable(cache)
    with torch.inference_mode():
        out = _forward_prompt(target, cache, ids, drafter.wants_hidden, cancel)
        if out is None:
            target.release(cache)
            return None
        logits = out.logits[-1] if rules is None else rules.shape_next(out.logits[-1])
        first = next_token(logits, params, generator)
        if rules is not None:
            rules.advance([first])
        state = DecodeState(lm, params, cache, [*ids, first], len(ids), generator, rules=rules)
        session = start_session(drafter, state, out.states)
        logprobs = _logprobs(logits[None], [first], params)
    return state, session, logprobs


def _forward_prompt(target, cache, ids: list[int], states: bool,
                    cancel: threading.Event | None) -> Forward | None:
    """The prompt's forward in chunks of PREFILL_CHUNK tokens (one call when it fits): the
    last token's logits, every layer's (1, P, H) states when asked. None when `cancel` was
    set before a chunk."""
    parts = []
    for begin in range(0, len(ids), PREFILL_CHUNK):
        if cancel is not None and cancel.is_set():
            return None
        parts.append(target.forward(cache, ids[begin:begin + PREFILL_CHUNK], begin,
                                    states=states, last_only=True))
    if len(parts) == 1 or not states:
        return Forward(parts[-1].logits, parts[-1].states)
    layers = zip(*[p.states for p in parts], strict=True)
    return Forward(parts[-1].logits, tuple(torch.cat(layer, dim=1) for layer in layers))


def _step(state: DecodeState, session: Session, ends: Ends,
          produced: int) -> tuple[list[int], str, int, int, list | None]:
    """One full-model forward: (new tokens, stop reason or "", accepted drafts, drafted,
    the new tokens' logprobs when asked).

    When the reply ends inside the accepted block (EOS, a stop string, the token budget),
    the block is cut there before the drafter commits, so the cache, the ids and every
    count hold exactly what plain decoding would have produced.
    """
    with torch.inference_mode():
        draft = session.propose(state)
        logits, hidden = session.score(state, draft)
        if state.rules is not None:  # each row as plain decoding would see it
            logits = state.rules.shape(logits, draft.children, draft.tokens)
        path, nxt = accept(draft, logits, state.params, state.generator)
        new = [draft.tokens[i] for i in path] + [nxt]
        keep, reason = ends.emitted(new, produced)
        if keep < len(new):  # the last kept token becomes the pending one
            path, new = path[:keep - 1], new[:keep]
        session.commit(state, draft, path)
        state.ids.extend(new)
        if state.rules is not None:
            state.rules.advance(new)
        if hidden is not None:
            state.hidden = hidden[path[-1] if path else 0]
        logprobs = _logprobs(logits[[0, *path]], new, state.params)
    return new, reason, len(path), draft.size - 1, logprobs


def _logprobs(rows: torch.Tensor, tokens: list[int], params: SamplingParams) -> list | None:
    """The logprobs of `tokens`, each chosen from its row of (m, V) shaped logits, when
    `params` asks for them."""
    if params.logprobs is None:
        return None
    return top_logprobs(rows, tokens, params.logprobs)


def accept(
    draft: Draft, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[list[int], int]:
    """Dispatch to the acceptance rule for this draft and these sampling settings."""
    mode = params.acceptance_mode
    if draft.size == 1:  # nothing drafted: the model's own choice
        return [], next_token(logits[0], params, generator)
    if mode == "greedy":
        return verify.accept_greedy(draft.children, draft.tokens, greedy_ids(logits).tolist())
    # float32 (no copy when it already is): the rules reduce over the vocabulary per node,
    # which CPUs do several times slower in bf16.
    logits = logits.float()
    if mode == "typical":
        return verify.accept_typical(draft.children, draft.tokens, logits_to_probs(logits, params),
                                     params.typical_eps, params.typical_delta, generator)
    probs = verify.probabilities(logits, params)
    if draft.draft_probs is not None:
        return verify.accept_speculative_chain(draft.tokens, draft.draft_probs, probs, generator)
    return verify.accept_pointmass(draft.children, draft.tokens, probs, generator)


@dataclass(frozen=True)
class Ends:
    """Where a reply ends: the model's EOS, the token budget or a stop string."""

    eos_ids: tuple[int, ...]
    max_new_tokens: int
    stream: TextStream  # the reply's text so far (stop strings are found in text)

    def emitted(self, new: list[int], produced: int) -> tuple[int, str]:
        """How many of `new` (after `produced` tokens) plain decoding would emit, and why
        it would stop there ("" = it goes on)."""
        keep, reason = len(new), ""
        eos = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
        if eos is not None:  # EOS is kept, as generate() does
            keep, reason = eos + 1, "eos"
        room = self.max_new_tokens - produced
        if keep > room or (keep == room and not reason):
            keep, reason = room, "length"
        stop = self.stream.stop_within(new[:keep])
        if stop is not None:
            keep, reason = stop, "stop"
        return keep, reason


def _last(stats: GenerationStats) -> int:
    return stats.accepted[-1] if stats.accepted else 0


def run(lm: LoadedModel, prompt_ids: list[int], params: SamplingParams,
        drafter: Drafter | None = None, cancel: threading.Event | None = None,
        grammar: Grammar | None = None) -> tuple[str, list[int], GenerationStats]:
    """`generate` to the end: (text, token ids, stats)."""
    ids: list[int] = []
    for event in generate(lm, prompt_ids, params, drafter, cancel, grammar):
        ids.extend(event.token_ids)
        if event.done:
            return event.full_text, ids, event.stats
    raise AssertionError("the decode loop ended without a final event")
