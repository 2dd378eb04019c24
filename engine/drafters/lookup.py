"""Model-free drafting by n-gram lookup in the prompt and the reply so far.

When the latest tokens already occurred earlier (a summary quoting its source, a code edit
repeating the original lines), the tokens that followed them then are a cheap, often right
guess for what follows now. Verification is the shared loop's: greedy stays exact, and
sampling treats the continuation as point-mass proposals, which is lossless.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.config import SamplingParams
from engine.decode.drafter import Draft, Drafter, DraftOffer, Session
from engine.decode.timing import step_cost


@dataclass(frozen=True)
class LookupParams:
    """How matches are searched and how much is drafted."""

    max_ngram: int = 3  # longest suffix tried first; a match this long is a copy in progress
    min_ngram: int = 1  # shortest suffix still worth a draft
    # A copy in progress drafts HF's prompt_lookup_num_tokens; a shorter match, seldom right
    # past its first token or two, drafts short_len (see fitted). Fixed lengths: one adapted
    # to each reply's acceptance was no faster.
    copy_len: int = 10
    short_len: int = 2


# Where verifying copy_len drafts costs at most this many plain steps, shorter matches draft
# copy_len too. Measured on a 2-core CPU: bf16 ~1.15 plain steps (Lookup 1.30x plain decoding
# with long chains, 1.23x with short ones), fp32 ~2.2 (0.91x long, 1.21x short).
LONG_CHAIN_COST = 1.5


def fitted(lm, params: LookupParams | None = None,
           sampling: SamplingParams | None = None) -> LookupParams:
    """`params` with short_len raised to copy_len where long chains cost little here (a
    model's step-cost curve for replies with `sampling`, None: greedy ones; timed once per
    loaded model)."""
    params = params or LookupParams()
    long_chain = step_cost(lm, sampling)(params.copy_len + 1)  # the pending token and the copy
    return replace(params, short_len=params.copy_len) if long_chain <= LONG_CHAIN_COST else params


class NgramIndex:
    """Most recent position after each n-gram of a growing token list, n in [lo, hi]."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ids: list[int] = []
        self.next_pos: dict[tuple[int, ...], int] = {}  # n-gram -> index just after it

    def extend(self, ids: list[int]) -> None:
        """Append tokens; index every n-gram that ends before the last token.

        The n-gram ending at the last token is indexed only once a token follows it, so a
        lookup of the current suffix finds an earlier occurrence, never itself.
        """
        start = len(self.ids)
        self.ids.extend(ids)
        for end in range(max(start, 1), len(self.ids)):
            for n in range(self.lo, self.hi + 1):
                if end - n >= 0:
                    self.next_pos[tuple(self.ids[end - n:end])] = end

    def sync(self, ids: list[int]) -> None:
        """Catch up with a token list this index is a prefix of (the decode loop's ids)."""
        self.extend(ids[len(self.ids):])

    def match(self, length: int) -> tuple[list[int], int]:
        """(continuation, n): up to `length` tokens that followed the longest earlier match of
        the current suffix, and that match's n-gram length; ([], 0) without a match."""
        for n in range(self.hi, self.lo - 1, -1):
            if len(self.ids) < n:
                continue
            pos = self.next_pos.get(tuple(self.ids[-n:]))
            if pos is not None:
                return self.ids[pos:pos + length], n
        return [], 0


# What a continuation's tokens are kept with before this reply says otherwise: each token
# after a kept one, by the matched n-gram's length (a copy in progress: a max_ngram match).
# Each reply then counts what its own continuations kept (PRIOR_WEIGHT: how many tokens'
# worth the prior counts for).
PRIOR_COPY, PRIOR_SHORT, PRIOR_WEIGHT = 0.8, (0.3, 0.5), 4.0


class LookupDrafter(Drafter):
    """Drafts the continuation of the latest n-gram's previous occurrence."""

    name = "lookup"
    drafts = True

    def __init__(self, params: LookupParams | None = None,
                 fit: Callable[[SamplingParams], LookupParams] | None = None) -> None:
        self.params = params or LookupParams()  # greedy replies' (all, where fit is None)
        self.fit = fit  # sampling -> a sampled reply's, fitted to its step costs

    @classmethod
    def timed(cls, lm) -> LookupDrafter:
        """Chain lengths fitted to `lm`'s step costs: greedy replies' at load, a sampled
        reply's when it starts (its curve is timed then, once per kind of sampling)."""
        return cls(fitted(lm), lambda sampling: fitted(lm, sampling=sampling))

    def start(self, state, prefill) -> LookupSession:
        sampled = self.fit is not None and not state.params.greedy
        return LookupSession(self.fit(state.params) if sampled else self.params)


class LookupSession(Session):
    """One reply's n-gram index, and how often its continuations were kept so far."""

    def __init__(self, params: LookupParams) -> None:
        self.params = params
        self.index = NgramIndex(params.min_ngram, params.max_ngram)
        self.kept: dict[bool, list[float]] = {}  # copying? -> [tokens kept, tokens missed]
        self._copying = False  # whether this step's offer was a copy in progress

    def match(self, ids: list[int], room: int) -> tuple[list[int], int]:
        """(continuation, matched n-gram length) for the current suffix of `ids` (which
        extends the ids seen before): copy_len tokens for a copy in progress, else
        short_len, and never more than `room`."""
        self.index.sync(ids)
        chain, n = self.index.match(min(self.params.copy_len, room))
        return (chain if self.copying(n) else chain[:self.params.short_len]), n

    def copying(self, n: int) -> bool:
        """Whether a match of `n` tokens is a copy in progress: then its continuation is
        verified alone."""
        return n == self.params.max_ngram

    def propose(self, state) -> Draft:
        return Draft.chain(state.ids[-1], self.match(state.ids, state.room)[0])

    def chance(self, n: int) -> float:
        """The chance that a token of this step's continuation is kept after the one before
        it was: the prior for its kind of match, updated by this reply's counts."""
        copying = self.copying(n)
        prior = PRIOR_COPY if copying else PRIOR_SHORT[min(n, len(PRIOR_SHORT)) - 1]
        kept, missed = self.kept.get(copying, (0.0, 0.0))
        return (PRIOR_WEIGHT * prior + kept) / (PRIOR_WEIGHT + kept + missed)

    def offer(self, state) -> DraftOffer | None:
        chain, n = self.match(state.ids, state.room)
        if not chain:
            return None
        p, root = self.chance(n), state.ids[-1]
        self._copying = self.copying(n)
        chances = [p ** i for i in range(1, len(chain) + 1)]
        return DraftOffer("copy" if self._copying else "lookup",
                          lambda k: Draft.chain(root, chain[:k], chances=chances[:k]),
                          chances=tuple(chances), joins=not self._copying)

    def observe(self, state, layers, path: list[int], offered: list[int]) -> None:
        if offered:
            kept = sum(node in path for node in offered)
            counts = self.kept.setdefault(self._copying, [0.0, 0.0])
            counts[0] += kept
            counts[1] += kept < len(offered)
