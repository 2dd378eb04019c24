"""Whether drafting pays here: expected tokens per step against step times measured on
this machine, in this dtype, on this device (the plain step and the cost curve are
engine.timing's, timed once per loaded model; a drafter's own round is timed here).

Calibration times an accelerator where it was trained. Loaded in another dtype (fp32
instead of bf16, 4-bit), on another device or on another machine (a shipped accelerator),
a drafted step costs a different multiple of a plain one (on one CPU bf16 verifies 8 tokens
for ~1.1 plain steps, on another without bf16 arithmetic for ~6), so the drafter re-times its
steps at load and decodes plainly, saying so, where the estimate does not beat plain
decoding by PAY_MARGIN.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from engine import devices, kernels, timing
from engine.config import SamplingParams
from engine.drafters.base import DecodeState, Draft, Drafter, Session, start_session
from engine.sampling import make_generator

# An estimate must beat plain decoding by this factor: estimates from held-out acceptance
# and a few timed steps run a little high, and a drafter that only breaks even costs memory.
PAY_MARGIN = 1.1


@dataclass(frozen=True)
class Payoff:
    """A drafted step against a plain one, here."""

    tokens_per_step: float  # expected tokens a drafted step adds (its own token included)
    plain_s: float  # seconds of one plain decode step, measured here
    step_s: float  # seconds of one drafted step (propose + verify), measured here

    @property
    def speedup(self) -> float:
        """Estimated decoding speed over plain decoding."""
        return self.tokens_per_step * self.plain_s / self.step_s

    @property
    def pays(self) -> bool:
        return self.speedup > PAY_MARGIN


def machine(lm) -> str:
    """What step times depend on besides the dtype: the processor (or GPU), the threads,
    torch and which low-bit kernels run. Calibration records it with its timings."""
    if lm.device.type == "cuda":
        where = torch.cuda.get_device_name(lm.device)
    else:
        where = f"{devices.cpu_name()}, {torch.get_num_threads()} threads"
        if lm.quant in ("int4", "int8w", "gguf") and kernels.available():
            where += ", own int8 kernel"
    return f"{where}, torch {torch.__version__}"


def timed_elsewhere(settings: dict, lm) -> bool:
    """True unless calibration timed this accelerator in `lm`'s dtype on this machine
    (checkpoints that did not record one, shipped ones among them, are taken as timed
    elsewhere)."""
    return (settings.get("quant") != lm.quant
            or settings.get("device", lm.device.type) != lm.device.type
            or settings.get("machine") != machine(lm))


def not_paying_notice(method: str, lm, speedup: float) -> str:
    """What a reply says when a drafter falls back to plain decoding here."""
    return (f"{method} is estimated at {speedup:.2f}x plain decoding in {lm.quant} on this "
            f"{lm.device.type.upper()}: decoding plainly (retrain it here to fit this setup)")


def round_seconds(lm, drafter: Drafter, ids: list[int] | None = None,
                  repeats: int = 3) -> float:
    """Median seconds of one decode step of `lm` with `drafter` (propose, verify, commit)
    whose drafts are all rejected, after the prompt `ids` (None: 192 made-up tokens). Only
    its latest tokens are used where the drafts would otherwise pass the model's window."""
    if ids is None:
        ids = [(7 * i) % int(lm.model.config.vocab_size) for i in range(1, 193)]
    n = max(2, min(len(ids), lm.context_len - 16 - repeats))  # drafts stay inside the window
    ids = list(ids[-n:])
    cache = lm.target.new_cache()
    times = []
    with torch.inference_mode():
        out = lm.target.forward(cache, ids[:-1], 0, states=drafter.wants_hidden,
                                last_only=True)
        state = DecodeState(lm, SamplingParams(), cache, list(ids), n - 1,
                            make_generator(0, lm.device))
        session = start_session(drafter, state, out.states)
        for _ in range(repeats + 1):  # the first round warms up
            times.append(timing.seconds(lm.device, _round, session, state))
    return statistics.median(times[1:])


def _round(session: Session, state: DecodeState) -> None:
    """One decode step whose drafts are all rejected."""
    draft = session.propose(state)
    session.score(state, draft)
    session.commit(state, draft, [])
    state.ids.append(draft.tokens[-1])  # a rejected step still adds the model's token


class FixedChain(Drafter):
    """Drafts `n` copies of the pending token: a chain of n drafts the model mostly
    rejects (what exactness checks of long verification steps need)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def start(self, state, prefill) -> Session:
        return _Repeat(self.n)


class _Repeat(Session):
    def __init__(self, n: int) -> None:
        self.n = n

    def propose(self, state) -> Draft:
        return Draft.chain(state.ids[-1], [state.ids[-1]] * self.n)
