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
    draft_len: int = 10  # tokens proposed after a match (HF's prompt_lookup_num_tokens)


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

    def continuation(self, length: int) -> list[int]:
        """Tokens that followed the longest earlier match of the current suffix."""
        for n in range(self.hi, self.lo - 1, -1):
            if len(self.ids) < n:
                continue
            pos = self.next_pos.get(tuple(self.ids[-n:]))
            if pos is not None:
                return self.ids[pos:pos + length]
        return []


class LookupDrafter(Drafter):
    """Drafts the continuation of the latest n-gram's previous occurrence."""

    name = "lookup"

    def __init__(self, params: LookupParams | None = None) -> None:
        self.params = params or LookupParams()
        self.index = NgramIndex(self.params.min_ngram, self.params.max_ngram)

    def start(self, state) -> None:
        self.index = NgramIndex(self.params.min_ngram, self.params.max_ngram)

    def propose(self, state) -> Draft:
        # Catch up with the tokens the loop appended since the last step.
        self.index.extend(state.ids[len(self.index.ids):])
        return Draft.chain(state.ids[-1], self.index.continuation(self.params.draft_len))
