"""Trained drafters mixed with prompt lookup: copying pays on summaries, translations and
code edits, the trained drafter everywhere else, and one verification pass serves both.

- Medusa+lookup: the heads' calibrated tree plus a shorter match's short continuation as
  one more branch under the root (its buffers are built once per branch length); while a
  3-gram match is being copied, the continuation alone.
- Kangaroo+lookup: a round drafts the lookup continuation when the latest tokens match an
  earlier n-gram of at least `min_match` tokens, and the adapter otherwise.

Both stay lossless through the shared acceptance rules: greedy follows the target's argmax
(the deepest path where two branches agree), and lookup tokens are point-mass proposals.
"""

from __future__ import annotations

from functools import partial

from engine.drafters.base import Draft
from engine.drafters.composite import Composite, Step
from engine.drafters.kangaroo import KangarooDrafter
from engine.drafters.lookup import LookupDrafter, LookupParams
from engine.drafters.medusa import MedusaDrafter
from engine.tree import TreeShape, with_chain


class TreeWithChain:
    """A tree draft with a lookup chain hung under its root (after the tree's nodes); the
    chain alone where no tree was drafted."""

    def __init__(self, tree) -> None:
        self.tree = tree
        self._shapes: dict[int, TreeShape] = {}  # chain length -> merged structure

    def __call__(self, draft: Draft, chain: list[int]) -> Draft:
        if not chain:
            return draft
        if draft.size == 1 or draft.size != self.tree.size:  # no tree pays, or no room for it
            return Draft.chain(draft.tokens[0], chain)
        shape = self._shapes.get(len(chain))
        if shape is None:
            shape = self._shapes[len(chain)] = with_chain(self.tree, len(chain))
        return Draft([*draft.tokens, *chain], shape.children, shape.depths, shape.mask)


def lookup_match(c: Composite, state) -> tuple[list[int], int]:
    """The lookup source's continuation and matched n-gram length for this step."""
    return c.sources["lookup"].source.match(state.ids, state.room)


def tree_or_copy(c: Composite, state, merge: TreeWithChain) -> Step:
    """Medusa+lookup's choice: while a 3-gram match is being copied, its continuation alone
    (the heads' guesses would only add verification cost); else the heads' tree with a
    shorter match's continuation beside it."""
    chain, n = lookup_match(c, state)
    if chain and c.sources["lookup"].source.copying(n):
        return Step("copy", "lookup", Draft.chain(state.ids[-1], chain))
    medusa = c.sources["medusa"]
    return Step("medusa+lookup", "medusa", merge(medusa.propose(state), chain))


def adapter_or_lookup(c: Composite, state, min_match: int) -> Step:
    """Kangaroo+lookup's choice: a round of the lookup continuation where a match of at
    least `min_match` tokens exists (run through Kangaroo's shallow layers, which verify
    it), else an adapter round."""
    chain, n = lookup_match(c, state)
    kangaroo = c.sources["kangaroo"]
    if chain and (n >= min_match or kangaroo.off):
        return Step("lookup", "kangaroo", kangaroo.propose_chain(state, chain))
    return Step("kangaroo", "kangaroo", kangaroo.propose(state))


def medusa_lookup(medusa: MedusaDrafter, lookup: LookupParams | None = None) -> Composite:
    """Medusa's tree with the lookup continuation beside it."""
    return Composite("medusa+lookup", {"lookup": LookupDrafter(lookup or LookupParams()),
                                       "medusa": medusa},
                     partial(tree_or_copy, merge=TreeWithChain(medusa.tree)), lead="medusa")


def kangaroo_lookup(kangaroo: KangarooDrafter, lookup: LookupParams | None = None,
                    min_match: int = 2) -> Composite:
    """Kangaroo rounds, replaced by the lookup continuation where a long enough match exists."""
    # min_match: the shortest matched n-gram whose continuation is drafted
    return Composite("kangaroo+lookup", {"lookup": LookupDrafter(lookup or LookupParams()),
                                         "kangaroo": kangaroo},
                     partial(adapter_or_lookup, min_match=min_match), lead="kangaroo")
