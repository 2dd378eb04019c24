"""Model-free drafting by n-gram lookup in the prompt and the reply so far.

When the latest tokens already occurred earlier (a summary quoting its source, a code edit
repeating the original lines), the tokens that followed them then are a cheap, often right
guess for what follows now. Verification is the shared loop's: greedy stays exact, and
sampling treats the continuation as point-mass proposals, which is lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.drafters.base import Draft, Drafter


@dataclass(frozen=True)
class LookupParams:
    """How matches are searched and how much is drafted."""

    max_ngram: int = 3  # longest suffix tried first (longer matches predict better)
    min_ngram: int = 1  # shortest suffix still worth a draft
    draft_len: int = 10  # most tokens proposed after a match (HF's prompt_lookup_num_tokens)
    # Each drafted token costs a share of a step, so the length adapts within a reply (the
    # schedule of HF's assisted generation): +2 after a fully accepted draft, -1 after a
    # rejection, starting here. A reply that copies grows long drafts; one that does not
    # stops paying for ten wrong tokens per step.
    start_len: int = 4
    adaptive: bool = True  # False: always draft_len


def next_length(length: int, drafted: int, accepted: int, params: LookupParams) -> int:
    """The draft length after a step that drafted `drafted` lookup tokens and kept
    `accepted` of them."""
    if not params.adaptive:
        return params.draft_len
    if drafted == 0:
        return length
    if accepted == drafted:
        return min(params.draft_len, length + 2)
    return max(1, length - 1)


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
    """One generation's lookup state: the n-gram index and the adaptive draft length."""

    def __init__(self, params: LookupParams) -> None:
        self.params = params
        self.reset()

    def reset(self) -> None:
        p = self.params
        self.index = NgramIndex(p.min_ngram, p.max_ngram)
        self.length = min(p.start_len, p.draft_len) if p.adaptive else p.draft_len

    def match(self, ids: list[int], room: int) -> tuple[list[int], int]:
        """(continuation, matched n-gram length) for the current suffix of `ids` (which
        extends the ids seen before), at most `room` tokens. A match of the longest n-gram
        is a copy in progress: it drafts the full length; shorter matches draft the
        adaptive length."""
        self.index.sync(ids)
        chain, n = self.index.match(min(self.params.draft_len, room))
        return (chain if self.copying(n) else chain[:self.length]), n

    def copying(self, n: int) -> bool:
        """Whether a match of `n` tokens (match's second value) is a copy in progress: then
        the continuation alone is drafted, at full length."""
        return n == self.params.max_ngram

    def update(self, drafted: int, accepted: int) -> None:
        """After verification: `accepted` of the `drafted` lookup tokens were kept."""
        self.length = next_length(self.length, drafted, accepted, self.params)


class LookupDrafter(Drafter):
    """Drafts the continuation of the latest n-gram's previous occurrence."""

    name = "lookup"

    def __init__(self, params: LookupParams | None = None) -> None:
        self.source = LookupSource(params or LookupParams())

    def start(self, state, prefill) -> None:
        self.source.reset()

    def propose(self, state) -> Draft:
        return Draft.chain(state.ids[-1], self.source.match(state.ids, state.room)[0])

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        super().commit(state, draft, path)
        self.source.update(draft.size - 1, len(path))
