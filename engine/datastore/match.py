"""The datastore's search (engine/datastore/memory.py): for the latest tokens of a reply,
the longest earlier match in the store's suffix-indexed tiers and the tree of what followed
it, with counts (SuffixDecoding's drafting, arXiv 2411.04975, over a suffix array instead
of a suffix tree).

Matches are monotone (a suffix of a match matches), so the longest is binary searched; the
latest match is remembered, so that the next step's, for the same context grown by the
tokens just kept, extends it instead of searching again.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.datastore.suffix_index import SEP, SuffixIndex

if TYPE_CHECKING:
    from engine.datastore.params import DatastoreParams


@dataclass
class Continuations:
    """The tree of what followed the longest match (root = the context's last token)."""

    tokens: list[int] = field(default_factory=list)  # node tokens, parents before children
    parents: list[int] = field(default_factory=list)  # parent node (-1 = under the root)
    probs: list[float] = field(default_factory=list)  # estimated path probability
    counts: list[int] = field(default_factory=list)  # occurrences behind each node
    match_len: int = 0  # tokens of the context that matched
    # the chance the model keeps each node, smoothed (DatastoreParams.smoothing): what
    # a step's expected tokens are summed from
    expected: list[float] = field(default_factory=list)

    def top(self, k: int) -> Continuations:
        """The k nodes most likely kept, parents before children. A node is never likelier
        than its parent, and ties go to the earlier node, so every kept node's parent is
        kept."""
        ranked = sorted(range(len(self.tokens)), key=lambda i: (-self.expected[i], i))
        keep = sorted(ranked[:k])
        new = {old: i for i, old in enumerate(keep)}
        return Continuations([self.tokens[i] for i in keep],
                             [new[self.parents[i]] if self.parents[i] >= 0 else -1
                              for i in keep],
                             [self.probs[i] for i in keep], [self.counts[i] for i in keep],
                             self.match_len, [self.expected[i] for i in keep])


@dataclass
class _LastMatch:
    """The latest match, kept so that the next step's match extends it."""

    tiers: tuple  # the indexes it was found in (a store change makes new ones)
    length: int  # tokens of the context it was found for
    tail: list[int]  # that context's last max_match tokens
    m: int  # tokens matched
    ranges: list[tuple]  # (index, lo, hi) per tier where it occurs


class Matcher:
    """One store's search: continuation trees, and the latest match the next one extends."""

    def __init__(self) -> None:
        self._last: _LastMatch | None = None

    def continuations(self, tiers: tuple[SuffixIndex, ...], p: DatastoreParams,
                      context: list[int], max_nodes: int | None = None,
                      max_depth: int = 16) -> Continuations:
        """The longest suffix of `context` seen in the non-empty indexes `tiers` and the
        tree of what followed it: nodes taken greedily by estimated probability (count /
        parent count down the path), at most nodes_per_match per matched token and
        `max_nodes` in all."""
        budget = p.max_nodes if max_nodes is None else max_nodes
        ranges, m = self._match(tiers, p, context)
        out = Continuations(match_len=m)
        if not ranges or budget <= 0 or max_depth <= 0:
            return out
        budget = min(budget, int(p.nodes_per_match * m))
        # candidates: (-path prob, tiebreak, parent node, depth, token, ranges, count,
        # smoothed chance); the root (depth 0) is the context itself and is not drafted
        heap = [(-1.0, 0, -1, 0, None, ranges, sum(hi - lo for _ix, lo, hi in ranges), 1.0)]
        tie = 1
        while heap and len(out.tokens) < budget:
            neg, _t, node, depth, token, rs, count, chance = heapq.heappop(heap)
            if depth > 0:
                out.tokens.append(token)
                out.parents.append(node)
                out.probs.append(-neg)
                out.counts.append(count)
                out.expected.append(chance)
                node = len(out.tokens) - 1
            if depth >= max_depth:
                continue
            if count == 1:  # one occurrence: the rest is its text, at the same probability
                _chain(out, rs[0], m + depth, node, -neg, 1 / (1 + p.smoothing),
                       min(budget - len(out.tokens), max_depth - depth))
                continue
            # a child below min_prob has fewer than this many occurrences
            least = max(p.min_count, math.ceil(p.min_prob * count / -neg - 1e-9))
            for child, (sub, n) in _merged_children(rs, m + depth, least).items():
                prob = -neg * n / count
                if prob >= p.min_prob and n >= p.min_count:
                    heapq.heappush(heap, (-prob, tie, node, depth + 1, child, sub, n,
                                          chance * n / (count + p.smoothing)))
                    tie += 1
        return out

    def _match(self, tiers: tuple, p: DatastoreParams,
               context: list[int]) -> tuple[list[tuple], int]:
        """Ranges (index, lo, hi) of the longest matching suffix of `context`, and its
        length. Matches are monotone (a suffix of a match matches), so binary search.

        Decoding asks again for the same context grown by the tokens just kept. A match
        then grows by at most those k tokens (its part before them matched last time), so
        the last match narrowed by them, when it still occurs, is the longest; otherwise
        the search is bounded by it. A store change (new indexes) forgets the last match."""
        ctx = [int(t) for t in context[-p.max_match:]]
        lo_len, hi_len = p.min_match, len(ctx)
        last, n = self._last, len(context)
        if (last is not None and last.tiers == tiers and n >= last.length
                and [int(t) for t in context[last.length - len(last.tail):last.length]]
                == last.tail):
            k = n - last.length
            if k == 0:
                return last.ranges, last.m
            if last.m and last.m + k <= p.max_match:
                grown = _narrowed(last.ranges, last.m, ctx[-k:])
                if grown:
                    return self._remember(tiers, n, ctx, grown, last.m + k)
            hi_len = min(hi_len, max(last.m, p.min_match - 1) + k)
        best: tuple[list[tuple], int] = ([], 0)
        while lo_len <= hi_len:
            m = (lo_len + hi_len) // 2
            found = [(ix, *ix.find(ctx[-m:])) for ix in tiers]
            found = [f for f in found if f[2] > f[1]]
            if found:
                best, lo_len = (found, m), m + 1
            else:
                hi_len = m - 1
        return self._remember(tiers, n, ctx, *best)

    def _remember(self, tiers: tuple, n: int, ctx: list[int], ranges: list[tuple],
                  m: int) -> tuple[list[tuple], int]:
        self._last = _LastMatch(tiers, n, ctx, m, ranges)
        return ranges, m


def _chain(out: Continuations, where: tuple, offset: int, parent: int, prob: float,
           decay: float, room: int) -> None:
    """Append what follows one occurrence (index, lo, lo + 1) from `offset` on, up to
    `room` tokens and the end of its document, as a chain under `parent`; each node's
    smoothed chance is its parent's times `decay`."""
    ix, lo, _hi = where
    start = int(ix.sa[lo]) + offset
    for token in ix.tokens[start:start + max(0, room)].tolist():
        if token == SEP:
            return
        out.tokens.append(token)
        out.parents.append(parent)
        out.probs.append(prob)
        out.counts.append(1)
        out.expected.append((out.expected[parent] if parent >= 0 else 1.0) * decay)
        parent = len(out.tokens) - 1


def _narrowed(ranges: list[tuple], m: int, tokens: list[int]) -> list[tuple]:
    """The ranges of an m-token match narrowed to the suffixes that go on with `tokens`."""
    out = []
    for ix, lo, hi in ranges:
        for i, token in enumerate(tokens):
            lo, hi = ix.narrow(lo, hi, m + i, token)
            if lo >= hi:
                break
        if lo < hi:
            out.append((ix, lo, hi))
    return out


def _merged_children(ranges: list[tuple], offset: int,
                     min_n: int = 1) -> dict[int, tuple[list, int]]:
    """Children over all tiers: token -> ([(index, lo, hi)], occurrences); SEP left out,
    and so are some of those seen fewer than `min_n` times in all."""
    out: dict[int, tuple[list, int]] = {}
    total = sum(hi - lo for _ix, lo, hi in ranges)
    for ix, lo, hi in ranges:
        # the other tiers add at most their whole range to a child's count
        least = max(1, min_n - (total - (hi - lo)))
        toks, starts, ends = ix.children(lo, hi, offset, least)
        for t, s, e in zip(toks.tolist(), starts.tolist(), ends.tolist(), strict=True):
            if t == SEP:
                continue
            sub, n = out.get(t, ([], 0))
            out[t] = ([*sub, (ix, s, e)], n + e - s)
    return out
