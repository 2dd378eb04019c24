"""The one way from a request to the decode loop. The page's chat and Compare
(app/replies.py), the HTTP API and the terminal chat all reply through here: the prompt is
encoded once, the drafter resolved once, the figures computed once (the readout, the API
and the terminal only format them), and a finished reply of the model's own is learned
into its datastore, whose disk write starts only after the final step was handed over."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from app.drafting import Accelerators
from app.host import ModelHost
from app.speed_record import CpuWatch, measure_of
from engine.config import ChatPrompt, SamplingParams
from engine.decode.chat_template import encode
from engine.decode.drafter import Drafter
from engine.decode.generate import StepEvent, generate, run
from engine.decode.grammar import Grammar
from engine.decode.stats import GenerationStats


@dataclass(frozen=True)
class Ask:
    """What one reply is asked with."""

    prompt: ChatPrompt  # the conversation so far, ending with the user's message
    params: SamplingParams
    method: str = "off"  # acceleration asked for
    # an unusable method is an error (the terminal names it) rather than plain decoding
    # with a notice (the page and the API)
    strict: bool = False
    learn: bool = False  # a finished reply of the model's own goes to its datastore
    grammar: Grammar | None = None  # what the reply must match (engine/decode/grammar.py)
    ids: tuple[int, ...] | None = None  # the prompt already encoded (the API's), or None


@dataclass
class ReplyStep:
    """One streamed step of a reply, as every caller receives it."""

    text: str  # new, final text
    full_text: str  # the whole reply so far
    token_ids: list[int]  # the new tokens
    method: str  # acceleration in use (on the last step, Auto's arm: "auto:lookup")
    # tokens, elapsed, TTFT and accepted drafts so far; the engine's own on the last step
    stats: GenerationStats
    done: bool = False
    notices: list[str] = field(default_factory=list)  # new with this step
    reason: str = ""  # on the last step: how the drafter drafted (Auto says), if anything
    # the reply as a conversation stores it (role, content, accel, model, acceptance, and
    # its stats once done): the same dict on every step, growing
    message: dict = field(default_factory=dict)
    logprobs: list | None = None  # the new tokens' logprobs, when asked (engine StepEvent)


class ReplyCore:
    """Replies from the host's model with the accelerators' drafters. Every call expects
    the caller to hold the host's lock (generations never interleave)."""

    def __init__(self, host: ModelHost, accels: Accelerators):
        self.host = host
        self.accels = accels

    def stream(self, ask: Ask, cancel: threading.Event | None = None) -> Iterator[ReplyStep]:
        """Stream the reply to `ask`. Its learning (into memory, then to disk in the
        background) happens once the last step was taken, or the consumer left after it."""
        lm = self.host.lm
        resolved = self.accels.resolve(ask.method, ask.strict)
        ids = list(ask.ids) if ask.ids is not None else encode(lm.tokenizer, ask.prompt)
        message = {"role": "assistant", "content": "", "accel": resolved.method,
                   "model": lm.fingerprint, "acceptance": ask.params.acceptance}
        live, tokens, notices = GenerationStats(), [], list(resolved.notices)
        watch = CpuWatch()  # how busy the machine was while this reply decoded
        try:
            for event in generate(lm, ids, ask.params, resolved.drafter, cancel, ask.grammar):
                tokens += event.token_ids
                message["content"] = event.full_text
                if event.done and event.stats.stop_reason != "cancelled":
                    self.accels.record.add_reply(resolved.method,
                                                 measure_of(event.stats, watch.busy()))
                yield self._step(event, resolved.drafter, message, live, notices + event.notices)
                notices = []
        finally:  # after the final step was taken: never inside its latency
            if ask.learn and "stats" in message:
                self.accels.learn(message, tokens)

    @staticmethod
    def _step(event: StepEvent, drafter: Drafter, message: dict, live: GenerationStats,
              notices: list[str]) -> ReplyStep:
        """The caller's view of one engine event; `live` keeps the figures so far."""
        if event.done:
            message["accel"] = drafter.used()  # Auto's arm; its stats say which sources drafted
            message["stats"] = event.stats.to_json()
            return ReplyStep(event.text, event.full_text, event.token_ids, message["accel"],
                             event.stats, True, notices, drafter.reason(event.stats), message,
                             event.logprobs)
        if live.tokens == 0:
            live.ttft_s = event.elapsed_s  # the prefill and the first token
        else:
            live.accepted.append(event.accepted)  # one event per model step after it
            live.steps += 1
        live.tokens, live.elapsed_s = event.tokens, event.elapsed_s
        snapshot = dataclasses.replace(live, accepted=list(live.accepted))
        return ReplyStep(event.text, event.full_text, event.token_ids, message["accel"],
                         snapshot, False, notices, "", message, event.logprobs)

    def replay(self, ids: list[int], params: SamplingParams, drafter: Drafter | None,
               cancel: threading.Event | None) -> tuple[list[int], GenerationStats]:
        """Decode already encoded prompt ids to the end with `drafter` (None: plainly),
        learning nothing: Compare's runs. (token ids, stats)."""
        _text, out, stats = run(self.host.lm, ids, params, drafter, cancel)
        return out, stats

    def encode(self, prompt: ChatPrompt) -> list[int]:
        return encode(self.host.lm.tokenizer, prompt)
