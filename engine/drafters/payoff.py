"""Whether drafting pays here: a whole decode step with a trained drafter timed on this
machine, in this dtype, on this device and step kind, as a multiple of the plain step timed
in turn with it (so load on the machine hits both alike and the ratio stands); verifying
more or fewer tokens is priced by engine.decode.timing's step-cost curve.

A drafted step costs a different multiple of a plain one on every setup (on one CPU bf16
verifies 8 tokens for ~1.1 plain steps, on another without bf16 arithmetic for ~6), so
nothing timed where an accelerator was trained is reused: every load times its own, and a
drafter whose best estimate does not beat plain decoding decodes plainly and says so.
"""

from __future__ import annotations

import statistics

import torch

from engine import devices
from engine.config import SamplingParams
from engine.decode import timing
from engine.decode.drafter import DecodeState, Draft, Drafter, Session, start_session
from engine.decode.sampling import make_generator
from engine.weights import kernels


def machine(lm) -> str:
    """What step times depend on besides the dtype: the processor (or GPU), the threads,
    torch and which low-bit kernels run. Calibration records it with its timings."""
    own = lm.device.type == "cpu" and lm.quant in ("int4", "int8w", "gguf") and \
        kernels.available()
    return devices.machine(lm.device).describe("own int8 kernel" if own else "")


def not_paying_notice(method: str, lm, speedup: float) -> str:
    """What a reply says when a drafter falls back to plain decoding here."""
    return (f"{method} is not drafting: estimated at {speedup:.2f}x plain decoding in "
            f"{lm.quant} on this {lm.device.type.upper()}, so it decodes plainly (retrain it "
            "here to fit this setup)")


def prefilled(lm, drafter: Drafter | None = None, ids: list[int] | None = None
              ) -> tuple[DecodeState, Session | None]:
    """A decode state after the prompt `ids` (None: 192 made-up tokens, only the latest ones
    where drafts would otherwise pass the model's window), with `drafter`'s session."""
    if ids is None:
        ids = [(7 * i) % int(lm.model.config.vocab_size) for i in range(1, 193)]
    n = max(2, min(len(ids), lm.context_len - 32))
    ids = list(ids[-n:])
    cache = lm.target.new_cache()
    want = drafter is None or drafter.wants_hidden
    with torch.inference_mode():
        out = lm.target.forward(cache, ids[:-1], 0, states=want, last_only=True)
        state = DecodeState(lm, SamplingParams(), cache, ids, n - 1, make_generator(0, lm.device))
        if out.states is not None:
            state.hidden = out.states[-1][0, -1]
        session = None if drafter is None else start_session(drafter, state, out.states)
    return state, session


def round_ratio(lm, drafter: Drafter, rounds: int = 5) -> float:
    """Plain steps one decode step with `drafter` costs here (propose, verify, commit, every
    draft rejected), timed in turn with a plain step of the same model at the same position
    (so load on the machine hits both alike); the median of the per-round ratios."""
    state, session = prefilled(lm, drafter)
    timer = timing.StepTimer(lm)
    ratios = []
    with torch.inference_mode():
        _round(session, state)  # warm
        for _ in range(rounds):
            plain = timer.once(1)
            ratios.append(timing.seconds(lm.device, _round, session, state) / plain)
    return statistics.median(ratios)


def step_overhead(lm, drafter: Drafter, tokens: int) -> float:
    """Plain steps a decode step with `drafter` drafting `tokens - 1` tokens costs beyond
    what the step-cost curve prices verifying `tokens` at: the drafter's own work and the
    rest of a drafted step (its tree's mask, the states kept for it, the commit), timed as
    a whole step (round_ratio). Pricing only the drafter's work leaves that rest out, and
    an estimate just above plain decoding then decodes below it."""
    return max(0.0, round_ratio(lm, drafter) - timing.step_cost(lm)(tokens))


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
