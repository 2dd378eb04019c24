"""Trained drafters mixed with prompt lookup: copying pays on summaries, translations and
code edits, the trained drafter everywhere else, and one verification pass serves both.

- Medusa+lookup: the heads' calibrated tree plus the lookup continuation as one more branch
  under the root (its buffers are built once per chain length); while a long match is
  being copied, the continuation alone.
- Kangaroo+lookup: a round drafts the lookup continuation when the latest tokens match an
  earlier n-gram of at least `min_match` tokens, and the adapter otherwise.

The lookup side keeps its own adaptive length (engine.drafters.lookup.LookupSource), fed
with how many of its tokens each verification kept.

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
    """A tree draft with a lookup chain hung under its root (after the tree's nodes)."""

    def __init__(self, tree) -> None:
        self.tree = tree
        self._shapes: dict[int, TreeShape] = {}  # chain length -> merged structure

    def __call__(self, draft: Draft, chain: list[int]) -> Draft:
        if not chain:
            return draft
        if draft.size != self.tree.size:  # no tree pays here, or too little room is left
            return Draft.chain(draft.tokens[0], chain)
        shape = self._shapes.get(len(chain))
        if shape is None:
            shape = self._shapes[len(chain)] = with_chain(self.tree, len(chain))
        return Draft([*draft.tokens, *chain], shape.children, shape.depths, shape.mask)


def chain_accepted(draft: Draft, chain: int, path: list[int]) -> int:
    """How many of the draft's last `chain` nodes (a lookup chain) verification kept."""
    first = draft.size - chain
    return sum(1 for node in path if node >= first)


class MedusaLookupDrafter(MedusaDrafter):
    """Medusa's tree with the lookup continuation beside it."""

    name = "medusa+lookup"

    def __init__(self, lm, heads, tree, retimed=None,
                 lookup: LookupParams | None = None):
        super().__init__(lm, heads, tree, retimed)
        self.lookup = LookupSource(lookup or LookupParams())
        self.merge = TreeWithChain(tree)
        self._chain = 0  # lookup tokens in this step's draft (after the tree's nodes)

    def start(self, state, prefill) -> None:
        self.lookup.reset()

    def propose(self, state) -> Draft:
        chain, n = self.lookup.match(state.ids, state.room)
        self._chain = len(chain)
        if chain and self.lookup.copying(n):
            # A copy in progress: the heads' guesses would only add verification cost.
            return Draft.chain(state.ids[-1], chain)
        return self.merge(super().propose(state), chain)

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        super().commit(state, draft, path)
        self.lookup.update(self._chain, chain_accepted(draft, self._chain, path))


class KangarooLookupDrafter(KangarooDrafter):
    """Kangaroo rounds, replaced by the lookup continuation where a long enough match exists."""

    name = "kangaroo+lookup"

    def __init__(self, *args, lookup: LookupParams | None = None, min_match: int = 2, **kwargs):
        super().__init__(*args, **kwargs)
        self.lookup = LookupSource(lookup or LookupParams())
        self.min_match = min_match  # shortest matched n-gram whose continuation is drafted
        self._chain = 0  # lookup tokens drafted this round (0: the adapter drafted)

    def start(self, state, prefill) -> None:
        super().start(state, prefill)
        self.lookup.reset()

    def propose(self, state) -> Draft:
        chain, n = self.lookup.match(state.ids, state.room)
        self._chain = len(chain) if chain and (n >= self.min_match or self.off) else 0
        if self._chain:
            return self.propose_chain(state, chain)
        return super().propose(state)

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        super().commit(state, draft, path)
        self.lookup.update(self._chain, len(path) if self._chain else 0)
