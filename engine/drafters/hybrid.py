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

from engine.drafters.base import Draft
from engine.drafters.kangaroo import KangarooDrafter
from engine.drafters.lookup import LookupParams, LookupSource
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


class MedusaLookupDrafter(MedusaDrafter):
    """Medusa's tree with the lookup continuation beside it."""

    name = "medusa+lookup"

    def __init__(self, lm, heads, tree, retimed=None,
                 lookup: LookupParams | None = None):
        super().__init__(lm, heads, tree, retimed)
        self.lookup = LookupSource(lookup or LookupParams())
        self.merge = TreeWithChain(tree)

    def start(self, state, prefill) -> None:
        self.lookup.reset()

    def propose(self, state) -> Draft:
        chain, n = self.lookup.match(state.ids, state.room)
        if chain and self.lookup.copying(n):
            # A copy in progress: the heads' guesses would only add verification cost.
            return Draft.chain(state.ids[-1], chain)
        return self.merge(super().propose(state), chain)


class KangarooLookupDrafter(KangarooDrafter):
    """Kangaroo rounds, replaced by the lookup continuation where a long enough match exists."""

    name = "kangaroo+lookup"

    def __init__(self, *args, lookup: LookupParams | None = None, min_match: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.lookup = LookupSource(lookup or LookupParams())
        self.min_match = min_match  # shortest matched n-gram whose continuation is drafted

    def start(self, state, prefill) -> None:
        super().start(state, prefill)
        self.lookup.reset()

    def propose(self, state) -> Draft:
        chain, n = self.lookup.match(state.ids, state.room)
        if chain and (n >= self.min_match or self.off):
            return self.propose_chain(state, chain)
        return super().propose(state)
