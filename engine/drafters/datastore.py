"""Drafting from the datastore of the model's own outputs (engine/datastore.py).

Each step matches the longest suffix of the latest tokens against everything the model
has said before and drafts the tree of what followed, as wide and deep as the counts make
likely (SuffixDecoding). The tokens are point-mass proposals verified by the shared rules:
greedy replies equal plain greedy decoding and sampling stays lossless.

Where the store lives: `<data dir>/datastore/<fingerprint>/store.safetensors`, else the one
shipped for the bundled model in `assets/accelerators/<fingerprint>-datastore/`, else an
empty store (the app opens it with its sources, so it is rebuilt from them; a user's store
started from another version of the shipped one is rebuilt from the shipped one and them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.datastore_load import open_store
from engine.datastore_match import Continuations
from engine.datastore_memory import Datastore
from engine.drafters.base import Draft, Drafter
from engine.drafters.lookup import LookupParams, LookupSource, fitted
from engine.drafters.payoff import alone_size
from engine.paths import data_dir
from engine.timing import StepCost, step_cost
from engine.tree import TreeShape, build_tree, join_trees, shape_of

STORE_FILE = "store.safetensors"


def store_path(fingerprint: str) -> Path:
    """The user's datastore for the model `fingerprint`."""
    return data_dir() / "datastore" / fingerprint / STORE_FILE


def store_file(lm) -> Path:
    """Where the datastore of `lm` is saved."""
    return store_path(lm.fingerprint)


def shipped_path(fingerprint: str) -> Path:
    """The datastore shipped beside the bundled model's accelerators."""
    from engine.accelerators import shipped_root

    return shipped_root() / f"{fingerprint}-datastore" / STORE_FILE


def open_datastore(lm, sources=None) -> Datastore:
    """The datastore of `lm` (see the module docstring); `sources` () -> documents rebuilds
    a missing or refused one."""
    fp = lm.fingerprint
    return open_store(store_path(fp), fp, sources, fallback=shipped_path(fp))


def tree_draft(root: int, found: Continuations, cache: dict) -> Draft:
    """The continuation tree as a Draft rooted at `root` (tree buffers built once per shape,
    kept in `cache`)."""
    if not found.tokens:
        return Draft.chain(root, [])
    choices: list[tuple[int, ...]] = []
    kids = [0] * (len(found.tokens) + 1)  # children seen so far, per node (+1: the root)
    for parent in found.parents:
        base = choices[parent] if parent >= 0 else ()
        choices.append((*base, kids[parent + 1]))
        kids[parent + 1] += 1
    key = tuple(choices)
    tree = cache.get(key)
    if tree is None:
        tree = cache[key] = build_tree(choices, max(len(c) for c in choices))
    token_of = dict(zip(choices, found.tokens, strict=True))
    tokens = [root, *(token_of[c] for c in tree.choices[1:])]
    return Draft(tokens, tree.children, tree.depths, tree.mask)


class TreeJoin:
    """Grafts one draft onto another as one tree (engine.tree.join_trees); the structures
    are kept per shape, so a repeated shape costs no new mask."""

    MAX_SHAPES = 512  # shapes kept before the cache starts over

    def __init__(self) -> None:
        self._shapes: dict[tuple[int, ...], TreeShape] = {}

    def __call__(self, a: Draft, b: Draft) -> tuple[Draft, list[int]]:
        """(the joined draft, the joined nodes of b's non-root nodes)."""
        if b.size == 1:
            return a, []
        tokens, parents, where = join_trees(a.tokens, a.children, b.tokens, b.children)
        key = tuple(parents)
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= self.MAX_SHAPES:
                self._shapes.clear()
            shape = self._shapes[key] = shape_of(parents)
        return Draft(tokens, shape.children, shape.depths, shape.mask), where[1:]


class DatastoreDrafter(Drafter):
    """Drafts the datastore's continuation tree of the latest tokens, joined (as a trie)
    with the continuation of the latest n-gram's earlier occurrence in this conversation:
    SuffixDecoding's two sources, the model's earlier outputs and the request itself (a
    summary copies its source, which no earlier reply holds). In a composite it offers the
    store's tree alone (`offer`; the composite has its own lookup) and counts, through
    `mark` and `observe`, the nodes of the verified draft that were the store's. With a
    `cost` (steps timed here) it drafts only the store's nodes that pay for their
    verification (the composites size what they offer themselves)."""

    name = "datastore"
    drafts = True

    def __init__(self, store: Datastore, lookup: LookupParams | None = None,
                 cost: StepCost | None = None) -> None:
        self.store = store
        self.cost = cost
        self.lookup = LookupSource(lookup or LookupParams())  # this conversation's n-grams
        self._join = TreeJoin()
        self._trees: dict = {}  # choices -> TreeBuffers
        self._mine: list[int] = []  # nodes of this step's draft that came from the store
        self.drafted = 0  # draft tokens from the store in the current reply
        self.accepted = 0  # of which the model kept

    @classmethod
    def for_model(cls, lm, ckpt=None) -> DatastoreDrafter:
        return cls.timed(open_datastore(lm), lm)

    @classmethod
    def timed(cls, store: Datastore, lm) -> DatastoreDrafter:
        """Over `store`, its conversation lookup drafting as long as lookup does on `lm`
        and its trees sized by the step costs timed there."""
        return cls(store, fitted(lm), step_cost(lm))

    def start(self, state, prefill) -> None:
        self.drafted = self.accepted = 0
        self._mine = []
        self.lookup.reset()

    def offer(self, state, size: Callable[[list[float]], int] | None = None
              ) -> tuple[Draft, float]:
        """The continuation tree of the latest tokens and its expected accepted tokens
        (the sum of its nodes' smoothed chances); `size` (chances -> k) keeps only the k
        nodes most likely kept (a node is never likelier than its parent: still a tree)."""
        # room bounds the depth (positions), not the width
        found = self.store.continuations(state.ids, max_depth=state.room)
        if size is not None and found.tokens:
            found = found.top(size(found.expected))
        return tree_draft(state.ids[-1], found, self._trees), sum(found.expected)

    def mark(self, nodes: list[int]) -> None:
        """The nodes of the step's draft that the store proposed (in a composite)."""
        self._mine = nodes

    def propose(self, state) -> Draft:
        chain = self.lookup.match(state.ids, state.room)[0]
        size = None if self.cost is None else alone_size(self.cost)
        draft, self._mine = self._join(Draft.chain(state.ids[-1], chain),
                                       self.offer(state, size)[0])
        return draft

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        super().commit(state, draft, path)
        self.observe(state, None, path)

    def observe(self, state, layers, path: list[int]) -> None:
        mine = set(self._mine)
        self.drafted += len(mine)
        self.accepted += sum(node in mine for node in path)
        self._mine = []

    def finish(self, stats) -> None:
        stats.datastore_drafted += self.drafted
        stats.datastore_accepted += self.accepted
