"""Drafting from the datastore of the model's own outputs (engine/datastore/memory.py).

Each step matches the longest suffix of the latest tokens against everything the model
has said before and offers the tree of what followed, each node with its chance of being
kept from the counts (SuffixDecoding). The tokens are point-mass proposals verified by the
shared rules: greedy replies equal plain greedy decoding and sampling stays lossless.

Where the store lives: `<data dir>/datastore/<fingerprint>/store.safetensors`, else the one
shipped for the bundled model in `assets/accelerators/<fingerprint>-datastore/`, else an
empty store (the app opens it with its sources, so it is rebuilt from them; a user's store
started from another version of the shipped one is rebuilt from the shipped one and them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engine.config import SamplingParams
from engine.datastore.load import open_store
from engine.datastore.match import Continuations
from engine.datastore.memory import Datastore
from engine.decode.drafter import Draft, Drafter, DraftOffer, Session
from engine.decode.timing import StepCost, reply_cost, sampled_cost, step_cost
from engine.decode.tree import build_tree
from engine.drafters.composite import pick
from engine.paths import data_dir

STORE_FILE = "store.safetensors"


def store_path(fingerprint: str) -> Path:
    """The user's datastore for the model `fingerprint`."""
    return data_dir() / "datastore" / fingerprint / STORE_FILE


def store_file(lm) -> Path:
    """Where the datastore of `lm` is saved."""
    return store_path(lm.fingerprint)


def shipped_path(fingerprint: str) -> Path:
    """The datastore shipped beside the bundled model's accelerators."""
    from engine.drafters.accelerators import shipped_root

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
    chance_of = dict(zip(choices, found.expected, strict=True))
    tokens = [root, *(token_of[c] for c in tree.choices[1:])]
    return Draft(tokens, tree.children, tree.depths, tree.mask,
                 chances=[1.0, *(chance_of[c] for c in tree.choices[1:])])


class StoreDrafter(Drafter):
    """Drafts the datastore's continuation tree of the latest tokens: the model's earlier
    outputs (SuffixDecoding). The datastore method composes it with lookup in this
    conversation, SuffixDecoding's other source (a summary copies its source, which no
    earlier reply holds). Alone it drafts only the nodes that pay for their verification
    under `cost` (steps timed here)."""

    name = "datastore"
    drafts = True

    def __init__(self, store: Datastore, cost: StepCost | None = None,
                 sampled: Callable[[SamplingParams], StepCost] | None = None) -> None:
        self.store = store
        self.cost = cost or StepCost()  # greedy replies' step costs (all, where sampled is None)
        self.sampled = sampled  # params -> a sampled reply's (engine.decode.timing.sampled_cost)
        self.trees: dict = {}  # choices -> TreeBuffers (shapes only: shared by every reply)

    @classmethod
    def for_model(cls, lm, ckpt=None) -> StoreDrafter:
        return cls.timed(open_datastore(lm), lm)

    @classmethod
    def timed(cls, store: Datastore, lm) -> StoreDrafter:
        """Over `store`, its trees sized by the step costs timed on `lm` (a sampled
        reply's own curve, timed when the first such reply starts)."""
        return cls(store, step_cost(lm), sampled_cost(lm))

    def start(self, state, prefill) -> StoreSession:
        return StoreSession(self, reply_cost(state.params, self.cost, self.sampled))


class StoreSession(Session):
    """One reply's drafts from the store, and how many of them were kept."""

    def __init__(self, drafter: StoreDrafter, cost: StepCost) -> None:
        self.drafter = drafter
        self.cost = cost  # the step costs this reply's trees are cut by, drafting alone
        self.drafted = 0  # draft tokens from the store in this reply
        self.accepted = 0  # of which the model kept
        self._offered: list[int] = []  # the nodes it drafted this step, drafting alone

    def offer(self, state) -> DraftOffer | None:
        """The continuation tree of the latest tokens; a node's chance of being kept is its
        smoothed path probability from the store's counts."""
        # room bounds the depth (positions), not the width
        found = self.drafter.store.continuations(state.ids, max_depth=state.room)
        if not found.tokens:
            return None
        root, trees = state.ids[-1], self.drafter.trees
        return DraftOffer("datastore", lambda k: tree_draft(root, found.top(k), trees),
                          chances=tuple(sorted(found.expected, reverse=True)))

    def propose(self, state) -> Draft:
        offer = self.offer(state)
        chosen = pick([offer], self.cost)  # None: no offer, or no cut beats a plain step
        draft = Draft.chain(state.ids[-1], []) if chosen is None else offer.build(chosen[1])
        self._offered = list(range(1, draft.size))  # a plain step offers none
        return draft

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        super().commit(state, draft, path)
        self.observe(state, None, path, self._offered)

    def observe(self, state, layers, path: list[int], offered: list[int]) -> None:
        self.drafted += len(offered)
        self.accepted += sum(node in path for node in offered)

    def finish(self, stats) -> None:
        if stats is not None:
            stats.datastore_drafted += self.drafted
            stats.datastore_accepted += self.accepted
