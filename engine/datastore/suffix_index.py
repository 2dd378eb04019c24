"""A suffix array over token documents: the datastore's search structure (the tiers of
engine/datastore/memory.py, searched by engine/datastore/match.py).

Suffixes are sorted by their first SORT_DEPTH tokens; a pattern's occurrences are one
contiguous range, found by one bigram search and then narrowed token by token, and the
distinct tokens that follow a range are its children (the continuation tree's next level).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

SEP = -1  # ends every document; sorts before every token, never drafted
SORT_DEPTH = 32  # suffixes are sorted by this many tokens: longest match + deepest draft
GATHER_MAX = 256  # ranges up to this wide are matched in one gather, wider ones bisected


class SuffixIndex:
    """Suffix array over a padded token array; documents end with SEP."""

    def __init__(self, tokens: np.ndarray, sa: np.ndarray | None = None) -> None:
        # Pad so that reading SORT_DEPTH tokens past any start stays in bounds.
        self.tokens = np.concatenate([tokens.astype(np.int32),
                                      np.full(SORT_DEPTH + 1, SEP, np.int32)])
        n = len(tokens)
        self.sa = suffix_array(self.tokens, n) if sa is None else sa.astype(np.int32)
        t = self.tokens.astype(np.int64)
        # (first, second) token of each sorted suffix as one sortable key: bigram ranges
        # by one searchsorted.
        self.keys = (t[self.sa] + 1) * (1 << 32) + (t[self.sa + 1] + 1)

    @property
    def size(self) -> int:
        return len(self.sa)

    def find(self, pattern: list[int]) -> tuple[int, int]:
        """[lo, hi) of the suffixes starting with `pattern` (length >= 2)."""
        key = (pattern[0] + 1) * (1 << 32) + (pattern[1] + 1)
        lo, hi = (int(x) for x in np.searchsorted(self.keys, [key, key + 1]))
        j = 2
        while j < len(pattern) and hi - lo > GATHER_MAX:
            lo, hi = self.narrow(lo, hi, j, pattern[j])
            j += 1
        if j == len(pattern) or lo >= hi:
            return lo, hi
        # the rest of the pattern against every suffix left, in one block: the matching
        # suffixes are contiguous (sorted)
        block = self.tokens[self.sa[lo:hi, None] + np.arange(j, len(pattern))]
        same = np.flatnonzero((block == np.asarray(pattern[j:], np.int32)).all(1))
        return (lo + int(same[0]), lo + int(same[-1]) + 1) if len(same) else (lo, lo)

    def narrow(self, lo: int, hi: int, offset: int, token: int) -> tuple[int, int]:
        """The part of [lo, hi) (suffixes equal up to `offset`, so sorted by the token
        there) whose token at `offset` is `token`."""
        if hi - lo <= GATHER_MAX:  # one gather and two searches
            col = self.tokens[self.sa[lo:hi] + offset]
            return (lo + int(np.searchsorted(col, token)),
                    lo + int(np.searchsorted(col, token, side="right")))
        # a wide range (a frequent prefix): bisect, reading O(log n) tokens, not all of them
        def at(i: int) -> int:
            return self.tokens[self.sa[i] + offset]

        first = bisect_left(range(lo, hi), token, key=at) + lo
        return first, bisect_right(range(first, hi), token, key=at) + first

    def children(self, lo: int, hi: int, offset: int,
                 min_n: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Distinct tokens at `offset` of the suffixes [lo, hi) (sorted there) that occur
        at least `min_n` times: (tokens, starts, ends) of their sub-ranges; SEP (document
        end) included."""
        if min_n > 1 and hi - lo > GATHER_MAX:
            # every such token covers one of the positions lo, lo + min_n, ...: read those,
            # then bisect each one's extent (a wide range needs no full read)
            probes = self.tokens[self.sa[np.arange(lo, hi, min_n)] + offset]
            cands = probes[np.concatenate([[True], probes[1:] != probes[:-1]])].tolist()

            def at(i: int) -> int:
                return self.tokens[self.sa[i] + offset]

            starts = [bisect_left(range(lo, hi), t, key=at) + lo for t in cands]
            ends = [bisect_right(range(b, hi), t, key=at) + b for t, b in zip(cands, starts,
                                                                             strict=True)]
            toks, starts, ends = np.array(cands), np.array(starts), np.array(ends)
        else:
            col = self.tokens[self.sa[lo:hi] + offset]
            cut = np.flatnonzero(col[1:] != col[:-1]) + 1
            first = np.concatenate([[0], cut])
            toks, starts, ends = col[first], first + lo, np.concatenate([cut, [len(col)]]) + lo
        keep = ends - starts >= min_n
        return toks[keep], starts[keep], ends[keep]


def suffix_array(tokens: np.ndarray, n: int) -> np.ndarray:
    """Start positions 0..n-1 sorted by their first SORT_DEPTH tokens (prefix doubling;
    ties past that depth in any order). `tokens` is padded with SORT_DEPTH SEPs."""
    if n == 0:
        return np.zeros(0, np.int32)
    rank = tokens.astype(np.int64)
    k = 1
    while True:
        second = rank[np.arange(n) + k] if k < SORT_DEPTH else np.zeros(n, np.int64)
        order = np.lexsort((second, rank[:n]))
        a, b = rank[order], second[order]
        new = np.empty(n, np.int64)
        new[order] = np.concatenate([[0], np.cumsum((a[1:] != a[:-1]) | (b[1:] != b[:-1]))])
        rank = np.concatenate([new, np.full(len(tokens) - n, -1, np.int64)])
        k *= 2
        if k >= SORT_DEPTH or new[order[-1]] == n - 1:
            return order.astype(np.int32)
