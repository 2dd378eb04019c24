"""What a reply or a Compare is asked with, and what it streams back."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.store import Conversation
from engine.config import SamplingParams
from engine.neartie import Divergence
from engine.stats import GenerationStats


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
