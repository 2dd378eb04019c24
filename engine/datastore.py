"""A datastore of the model's own outputs: drafts from everything it has already said.

The text a local model writes next is often text it has written before (its openings and
closings, list and code idioms, the user's recurring topics). The store keeps the model's
replies as token documents and indexes every suffix of them (a suffix array, sorted by the
first `SORT_DEPTH` tokens), so that for the latest tokens of a reply it finds the longest
earlier match and the tree of what followed it, with counts (SuffixDecoding's drafting,
arXiv 2411.04975, over a suffix array instead of a suffix tree).

- Two tiers: `main` indexes the older documents and is rebuilt only when `recent` (every
  document added since) outgrows `recent_cap`, so a reply is searchable as soon as it ends
  at the cost of indexing that small tier again.
- Bounded: at most `max_tokens` tokens; the oldest documents go first.
- On disk (engine/datastore_file.py): a snapshot, one safetensors file, and beside it a log
  of the documents learned since, one checksummed record appended per reply and replayed
  at load. A reply then costs a few kilobytes on disk, not the whole store, and a kill at
  any moment loses at most the record being written (a torn last record is ignored). The
  snapshot is written again when the index is rebuilt (the log then starts over). A
  corrupt or foreign snapshot is refused with one line and rebuilt from the sources the
  caller names. No pickle anywhere.

Memory: 4 bytes per token for the tokens, 4 for the suffix array and 8 for the sorted
bigram keys, i.e. ~16 MB for 1M tokens.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from engine.datastore_file import (
    FORMAT_VERSION,
    KIND,
    Pending,
    Snapshot,
    log_path,
    new_lineage,
    read_log,
    write_snapshot,
)
from engine.suffix_index import SEP, SuffixIndex

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class DatastoreParams:
    """How much is kept and how the continuation tree is grown."""

    max_tokens: int = 1_000_000  # the cap: oldest documents out beyond it (~16 MB in memory)
    recent_cap: int = 65_536  # the small tier's size before it is folded into main
    max_match: int = 16  # longest suffix of the context that is matched
    min_match: int = 2  # shortest match still worth a draft
    max_nodes: int = 16  # most drafted tokens per step
    nodes_per_match: float = 2.0  # node budget per matched token (longer match, bigger tree)
    min_prob: float = 0.15  # a node is drafted only if its path's estimated probability is
    # at least this (count / parent count, multiplied down the path)
    min_count: int = 1  # a continuation seen fewer times is not drafted
    # Pseudo-occurrences added to every count when estimating how many drafted tokens the
    # model will keep (what deciding whether a tree pays needs): a continuation seen once
    # is no certainty. On held-out prompts the plain count ratios predicted 5.3x the store
    # tokens the model kept, with 2 pseudo-occurrences 1.7x (int4, 28 prompts).
    smoothing: float = 2.0


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


class Datastore:
    """The model's own outputs, searchable for drafting (see the module docstring)."""

    def __init__(self, fingerprint: str, params: DatastoreParams | None = None) -> None:
        self.fingerprint = fingerprint
        self.params = params or DatastoreParams()
        self.docs: list[np.ndarray] = []  # int32 token documents, oldest first
        self.main_docs = 0  # the first main_docs documents are in `main`
        self.main = SuffixIndex(np.zeros(0, np.int32))
        self.recent = SuffixIndex(np.zeros(0, np.int32))
        self._last: _LastMatch | None = None  # the latest match, which the next one extends
        self.seed = ""  # the shipped store this one started from (its file's hash), if any
        # Which log belongs to it: a log written for another lineage (a store since rebuilt)
        # is never replayed into it.
        self.lineage = new_lineage()
        self.serial = 0  # documents learned in this lineage: a record's number in the log

    @property
    def tokens(self) -> int:
        return sum(len(d) for d in self.docs)

    def learn(self, tokens: Iterable[int]) -> Pending | None:
        """add(tokens), and what it needs on disk (persist): its log record, and a whole
        snapshot when the index was rebuilt. None when the document was too short."""
        before = self.main
        doc = np.asarray(list(tokens), np.int32)
        if not self.add(doc):
            return None
        snapshot = self.snapshot() if self.main is not before else None
        return Pending(self.lineage, self.serial, doc, snapshot)

    def add(self, tokens: Iterable[int]) -> bool:
        """Learn one document (a reply's tokens): searchable when this returns. False when
        it is too short to draft from (nothing was added)."""
        doc = np.asarray(list(tokens), np.int32)
        if len(doc) < 2:
            return False
        self.serial += 1
        self.docs.append(doc[: self.params.max_tokens])
        over = self.tokens - self.params.max_tokens
        if over > 0:  # oldest out (a tenth more, so that main is not rebuilt every reply)
            over += self.params.max_tokens // 10
            while over > 0 and len(self.docs) > 1:
                over -= len(self.docs.pop(0))
            self.main_docs = len(self.docs) - 1
            self.main = SuffixIndex(_join(self.docs[: self.main_docs]))
        recent = self.docs[self.main_docs:]
        if sum(len(d) for d in recent) > self.params.recent_cap:
            self.main_docs = len(self.docs)
            self.main = SuffixIndex(_join(self.docs))
            recent = []
        self.recent = SuffixIndex(_join(recent))
        return True

    def add_all(self, docs: Iterable[Iterable[int]]) -> None:
        """Learn many documents with one index build (the newest last)."""
        for doc in docs:
            doc = np.asarray(list(doc), np.int32)
            if len(doc) >= 2:
                self.docs.append(doc)
                self.serial += 1
        while self.tokens > self.params.max_tokens and len(self.docs) > 1:
            self.docs.pop(0)
        self.main_docs = len(self.docs)
        self.main = SuffixIndex(_join(self.docs))
        self.recent = SuffixIndex(np.zeros(0, np.int32))

    def refill(self, docs: Iterable[Iterable[int]]) -> None:
        """Forget every document, then learn `docs` (the newest last)."""
        self.docs = []
        self.add_all(docs)

    def continuations(self, context: list[int], max_nodes: int | None = None,
                      max_depth: int = 16) -> Continuations:
        """The longest suffix of `context` seen before and the tree of what followed it:
        nodes taken greedily by estimated probability (count / parent count down the
        path), at most nodes_per_match per matched token and `max_nodes` in all."""
        p = self.params
        budget = p.max_nodes if max_nodes is None else max_nodes
        ranges, m = self._match(context)
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
                self._chain(out, rs[0], m + depth, node, -neg, 1 / (1 + p.smoothing),
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

    @staticmethod
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

    def _match(self, context: list[int]) -> tuple[list[tuple], int]:
        """Ranges (index, lo, hi) of the longest matching suffix of `context`, and its
        length. Matches are monotone (a suffix of a match matches), so binary search.

        Decoding asks again for the same context grown by the tokens just kept. A match
        then grows by at most those k tokens (its part before them matched last time), so
        the last match narrowed by them, when it still occurs, is the longest; otherwise
        the search is bounded by it. A store change (new indexes) forgets the last match."""
        p = self.params
        tiers = tuple(ix for ix in (self.main, self.recent) if ix.size)
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

    # -- disk ------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """What save() writes, taken now: the documents and indexes are replaced, never
        changed in place, so it stays as it is while the store learns on."""
        return Snapshot(self.fingerprint, dict(self.params.__dict__), self.seed, self.lineage,
                        self.serial, tuple(self.docs), self.main_docs, self.main.sa)

    def save(self, path: Path) -> None:
        """Write the snapshot atomically (engine.datastore_file); the log starts over."""
        write_snapshot(Path(path), self.snapshot())


def _replay(store: Datastore, path: Path) -> None:
    """Learn the log's records that came after the snapshot, in their order."""
    log = log_path(path)
    if not log.is_file():
        return
    _end, records = read_log(log.read_bytes(), store.lineage)
    for serial, tokens in records:
        if serial > store.serial:
            store.add(tokens)
            store.serial = serial


def load(path: Path, fingerprint: str, params: DatastoreParams | None = None) -> Datastore:
    """The store at `path` with its log replayed; ValueError (one line) for a corrupt,
    foreign or newer snapshot."""
    store = _load_snapshot(path, fingerprint, params)
    _replay(store, path)
    return store


def _load_snapshot(path: Path, fingerprint: str,
                   params: DatastoreParams | None = None) -> Datastore:
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as fh:
            meta = fh.metadata() or {}
        arrays = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"unreadable datastore {path}: {exc}") from None
    if meta.get("kind") != KIND or meta.get("version") != str(FORMAT_VERSION):
        raise ValueError(f"{path} is not a version-{FORMAT_VERSION} datastore")
    if meta.get("fingerprint") != fingerprint:
        raise ValueError(f"{path} was built for another model")
    tokens, lengths = arrays.get("tokens"), arrays.get("lengths")
    if tokens is None or lengths is None or int(lengths.sum()) != len(tokens):
        raise ValueError(f"{path} is corrupt: its documents do not add up")
    store = Datastore(fingerprint, params)
    store.docs = np.split(tokens.astype(np.int32), np.cumsum(lengths)[:-1]) if len(lengths) else []
    store.main_docs = int(meta.get("main_docs", 0))
    store.seed = meta.get("seed", "")
    store.lineage = meta.get("lineage") or store.lineage  # older files: a log of none
    store.serial = int(meta.get("serial", 0))
    main = _join(store.docs[: store.main_docs])
    sa = arrays.get("main_sa")
    if sa is None or len(sa) != len(main) or (len(sa) and (sa.min() < 0 or sa.max() >= len(main))):
        raise ValueError(f"{path} is corrupt: its index does not fit its tokens")
    store.main = SuffixIndex(main, sa)
    store.recent = SuffixIndex(_join(store.docs[store.main_docs:]))
    return store


def open_store(path: Path, fingerprint: str, sources: Callable[[], Iterable[list[int]]] | None,
               params: DatastoreParams | None = None,
               fallback: Path | None = None) -> Datastore:
    """The store at `path`; if it is missing, corrupt, foreign, or started from another
    version of the `fallback` file (the shipped one): that file, else a new store, with the
    documents of `sources` (oldest first) added and saved. A user's store is thereby rebuilt
    from the newer shipped store and the sources it was learned from (their chats and
    training answers), so an update's bigger store reaches them. A refused file is reported
    in one log line."""
    seed = _file_hash(fallback) if fallback is not None and Path(fallback).is_file() else ""
    store = _load_logged(path, fingerprint, params)
    if store is not None and (store.seed == seed or sources is None):  # None: cannot rebuild
        return store
    base = _load_logged(fallback, fingerprint, params) if seed else None
    store = base or Datastore(fingerprint, params)
    store.seed = seed if base else ""
    store.lineage = new_lineage()  # rebuilt: the old log (its documents are in the sources) ends
    if sources is None:
        return store
    docs = list(sources())
    if docs or base is None:
        store.add_all(docs)
    store.save(path)  # the new lineage is on disk before any record of it is logged
    return store


def _load_logged(path: Path | None, fingerprint: str,
                 params: DatastoreParams | None) -> Datastore | None:
    if path is None or not Path(path).is_file():
        return None
    try:
        return load(path, fingerprint, params)
    except ValueError as exc:
        log.warning("datastore refused, rebuilding it: %s", exc)
        return None


def _file_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _join(docs: list[np.ndarray]) -> np.ndarray:
    """Documents concatenated, each followed by SEP."""
    if not docs:
        return np.zeros(0, np.int32)
    return np.concatenate([np.append(d, SEP).astype(np.int32) for d in docs])


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
