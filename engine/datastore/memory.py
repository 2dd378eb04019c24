"""A datastore of the model's own outputs: drafts from everything it has already said.

The text a local model writes next is often text it has written before (its openings and
closings, list and code idioms, the user's recurring topics). The store keeps the model's
replies as token documents and indexes every suffix of them (a suffix array, sorted by the
first `SORT_DEPTH` tokens), so that for the latest tokens of a reply it finds the longest
earlier match and the tree of what followed it, with counts (engine/datastore/match.py).

- Two tiers: `main` indexes the older documents and is rebuilt only when `recent` (every
  document added since) outgrows `recent_cap`, so a reply is searchable as soon as it ends
  at the cost of indexing that small tier again.
- Bounded: at most `max_tokens` tokens; the oldest documents go first.
- On disk (engine/datastore/disk.py): a snapshot, one safetensors file, and beside it a log
  of the documents learned since, one checksummed record appended per reply and replayed
  at load. A reply then costs a few kilobytes on disk, not the whole store, and a kill at
  any moment loses at most the record being written (a torn last record is ignored). The
  snapshot is written again when the index is rebuilt (the log then starts over). Opening
  it (engine/datastore/load.py): a corrupt or foreign snapshot is refused with one line and
  rebuilt from the sources the caller names. No pickle anywhere.

Memory: 4 bytes per token for the tokens, 4 for the suffix array and 8 for the sorted
bigram keys, i.e. ~16 MB for 1M tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from engine.datastore.disk import Pending, Snapshot, new_lineage, write_snapshot
from engine.datastore.match import Continuations, Matcher
from engine.datastore.params import DatastoreParams
from engine.datastore.suffix_index import SEP, SuffixIndex


class Datastore:
    """The model's own outputs, searchable for drafting (see the module docstring)."""

    def __init__(self, fingerprint: str, params: DatastoreParams | None = None) -> None:
        self.fingerprint = fingerprint
        self.params = params or DatastoreParams()
        self.docs: list[np.ndarray] = []  # int32 token documents, oldest first
        self.main_docs = 0  # the first main_docs documents are in `main`
        self.main = SuffixIndex(np.zeros(0, np.int32))
        self.recent = SuffixIndex(np.zeros(0, np.int32))
        self._matcher = Matcher()  # its search, which remembers the latest match
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
            self.main = SuffixIndex(joined(self.docs[: self.main_docs]))
        recent = self.docs[self.main_docs:]
        if sum(len(d) for d in recent) > self.params.recent_cap:
            self.main_docs = len(self.docs)
            self.main = SuffixIndex(joined(self.docs))
            recent = []
        self.recent = SuffixIndex(joined(recent))
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
        self.main = SuffixIndex(joined(self.docs))
        self.recent = SuffixIndex(np.zeros(0, np.int32))

    def refill(self, docs: Iterable[Iterable[int]]) -> None:
        """Forget every document, then learn `docs` (the newest last)."""
        self.docs = []
        self.add_all(docs)

    def continuations(self, context: list[int], max_nodes: int | None = None,
                      max_depth: int = 16) -> Continuations:
        """The longest suffix of `context` seen before and the tree of what followed it:
        nodes taken greedily by estimated probability (count / parent count down the
        path), at most nodes_per_match per matched token and `max_nodes` in all
        (engine.datastore.match)."""
        tiers = tuple(ix for ix in (self.main, self.recent) if ix.size)
        return self._matcher.continuations(tiers, self.params, context, max_nodes, max_depth)

    # -- disk ------------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """What save() writes, taken now: the documents and indexes are replaced, never
        changed in place, so it stays as it is while the store learns on."""
        return Snapshot(self.fingerprint, dict(self.params.__dict__), self.seed, self.lineage,
                        self.serial, tuple(self.docs), self.main_docs, self.main.sa)

    def save(self, path: Path) -> None:
        """Write the snapshot atomically (engine.datastore.disk); the log starts over."""
        write_snapshot(Path(path), self.snapshot())


def joined(docs: list[np.ndarray]) -> np.ndarray:
    """Documents concatenated, each followed by SEP."""
    if not docs:
        return np.zeros(0, np.int32)
    return np.concatenate([np.append(d, SEP).astype(np.int32) for d in docs])
