"""Model-free drafting by n-gram lookup in the prompt and the reply so far.

When the latest tokens already occurred earlier (a summary quoting its source, a code edit
repeating the original lines), the tokens that followed them then are a cheap, often right
guess for what follows now. Verification is the shared loop's: greedy stays exact, and
sampling treats the continuation as point-mass proposals, which is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.drafters.base import Draft, Drafter
from engine.timing import step_cost


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


def fitted(lm, params: LookupParams | None = None) -> LookupParams:
    """`params` with short_len raised to copy_len where long chains cost little here (a
    model's step-cost curve, timed once per loaded model)."""
    params = params or LookupParams()
    long_chain = step_cost(lm)(params.copy_len + 1)  # the pending token and the copy
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


class LookupSource:
    """One generation's lookup state: the n-gram index over its ids."""

    def __init__(self, params: LookupParams) -> None:
        self.params = params
        self.reset()

    def reset(self) -> None:
        self.index = NgramIndex(self.params.min_ngram, self.params.max_ngram)

    def match(self, ids: list[int], room: int) -> tuple[list[int], int]:
        """(continuation, matched n-gram length) for the current suffix of `ids` (which
        extends the ids seen before): copy_len tokens for a copy in progress, else
        short_len, and never more than `room`."""
        self.index.sync(ids)
        chain, n = self.index.match(min(self.params.copy_len, room))
        return (chain if self.copying(n) else chain[:self.params.short_len]), n

    def copying(self, n: int) -> bool:
        """Whether a match of `n` tokens (match's second value) is a copy in progress: then
        the continuation alone is drafted."""
        return n == self.params.max_ngram


class LookupDrafter(Drafter):
    """Drafts the continuation of the latest n-gram's previous occurrence."""

    name = "lookup"
    drafts = True

    def __init__(self, params: LookupParams | None = None) -> None:
        self.source = LookupSource(params or LookupParams())

    def start(self, state, prefill) -> None:
        self.source.reset()

    def propose(self, state) -> Draft:
        return Draft.chain(state.ids[-1], self.source.match(state.ids, state.room)[0])

