"""The grammar's forced tokens as a draft source: where a reply's grammar allows one
continuation only (a JSON schema's keys, separators, the rest of an enum value), the tokens
that spell it are drafted (llguidance's fast-forward tokens, engine/decode/grammar.py), as
SGLang's jump-forward decoding does, and verified like any other draft, so greedy replies
stay exactly plain decoding and sampling lossless. A reply without a grammar gets no offer.

The model may still spell a forced text with other tokens than the canonical ones, so the
chance of each token being kept is counted per reply, from a high prior, as lookup does.
"""

from __future__ import annotations

from engine.decode.drafter import Draft, Drafter, DraftOffer, Session

# What a forced token is kept with before this reply says otherwise, and how many tokens'
# worth that prior counts for.
PRIOR_KEPT, PRIOR_WEIGHT = 0.9, 4.0
MAX_FORCED = 16  # the longest forced run drafted in one step


class GrammarDrafter(Drafter):
    """Drafts the tokens the reply's grammar forces next."""

    name = "grammar"
    drafts = True

    def start(self, state, prefill) -> GrammarSession:
        return GrammarSession()


class GrammarSession(Session):
    """One reply's forced runs, and how many of their tokens the model kept."""

    def __init__(self) -> None:
        self.kept, self.missed = 0.0, 0.0  # forced tokens kept / runs cut short this reply

    def forced(self, state) -> list[int]:
        """The forced tokens after the pending one, at most the room left."""
        if state.rules is None:
            return []
        return state.rules.forced()[:min(MAX_FORCED, state.room)]

    def chance(self) -> float:
        """The chance a forced token is kept after the one before it was."""
        return (PRIOR_WEIGHT * PRIOR_KEPT + self.kept) / (PRIOR_WEIGHT + self.kept + self.missed)

    def propose(self, state) -> Draft:
        return Draft.chain(state.ids[-1], self.forced(state))

    def offer(self, state) -> DraftOffer | None:
        tokens, root = self.forced(state), state.ids[-1]
        if not tokens:
            return None
        p = self.chance()
        return DraftOffer("grammar", lambda k: Draft.chain(root, tokens[:k]),
                          chances=tuple(p ** i for i in range(1, len(tokens) + 1)))

    def observe(self, state, layers, path: list[int], offered: list[int]) -> None:
        if offered:
            kept = sum(node in path for node in offered)
            self.kept += kept
            self.missed += kept < len(offered)
