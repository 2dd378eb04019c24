"""What a reply or a Compare is asked with, and what it streams back."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.store import Conversation, Store, StoreError, title_from_prompt
from engine.config import SamplingParams
from engine.neartie import Divergence
from engine.stats import GenerationStats

COMPARE_PROMPT = "Explain in a few sentences how a rainbow forms."  # Compare with no chat yet


@dataclass(frozen=True)
class ReplyRequest:
    """What a reply (or a Compare) is asked with."""

    conv_id: str  # the conversation it belongs to ("" for Compare: a stock prompt)
    params: SamplingParams  # sampling and length (Compare keeps the length, decodes greedily)
    method: str = "off"  # acceleration asked for (untrained: plain decoding, with a notice)
    system: str | None = None  # a new system prompt for the conversation; None = keep it
    owner: str = ""  # the browser session asking, so Stop only ends its own reply


@dataclass
class ReplyUpdate:
    """One streaming update of a reply: the chat view and its live readout."""

    conversation: Conversation  # its last message is the reply (it grows while streaming)
    method: str  # acceleration in use for this reply
    tokens: int  # tokens generated so far
    elapsed_s: float  # since the request started (prefill included)
    ttft_s: float  # time to the first token
    accepted: list[int]  # per full-model step so far: draft tokens accepted
    done: bool = False
    stats: GenerationStats | None = None  # on the last update
    notices: list[str] = field(default_factory=list)  # e.g. prompt truncated, fell back to Off

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class CompareResult:
    """The same prompt decoded greedily with acceleration off and on."""

    method: str  # the accelerated method
    prompt: str
    off: GenerationStats | None = None  # filled as each run ends
    on: GenerationStats | None = None
    identical: bool | None = None  # both runs produced the same tokens
    # where the texts first differ and whether the plain model's call there was within the
    # dtype's rounding (measured, not assumed); None while identical, running or stopped
    divergence: Divergence | None = None
    dtype: str = "float32"  # the weights' compute dtype, named in the verdict

    @property
    def ratio(self) -> float | None:
        if self.off is None or self.on is None or not self.off.tokens_per_s:
            return None
        return self.on.tokens_per_s / self.off.tokens_per_s

    @property
    def stopped(self) -> bool:
        return any(s is not None and s.stop_reason == "cancelled" for s in (self.off, self.on))


def add_prompt(conv: Conversation, prompt: str | None) -> None:
    """Append the new prompt, or (regenerate) drop the replies after the last prompt."""
    if prompt is not None:
        if not any(m["role"] == "user" for m in conv.messages):
            conv.title = title_from_prompt(prompt)
        conv.messages.append({"role": "user", "content": prompt})
        return
    while conv.messages and conv.messages[-1]["role"] == "assistant":
        conv.messages.pop()
    if not conv.messages:
        raise StoreError("nothing to regenerate: send a message first")


def save_reply(store: Store, conv: Conversation, reply: dict) -> None:
    """Save the conversation; a reply stopped before its first character is dropped."""
    if not reply["content"] and reply in conv.messages:
        conv.messages.remove(reply)
    store.save(conv)


def last_prompt(conv: Conversation | None) -> tuple[str, list[dict], str | None]:
    """(prompt, earlier turns, system) of the conversation's last user message."""
    turns = conv.turns() if conv is not None else []
    for i in range(len(turns) - 1, -1, -1):
        if turns[i]["role"] == "user":
            return turns[i]["content"], turns[:i], conv.system or None
    return COMPARE_PROMPT, [], None
