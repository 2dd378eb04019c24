"""The drafter interface, the state a generation carries from step to step, and plain
decoding as the simplest drafter.

A Drafter is what a method loaded for a model (weights, calibration, its verdict) and is
shared by every reply; `start` returns the Session of one reply, which holds everything
that reply changes. A step of the decode loop: the session's `propose` returns a Draft (a
tree of candidate tokens under the pending token), `score` runs the target model over it,
the shared acceptance rules pick a path, and `commit` keeps what was accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import SamplingParams

if TYPE_CHECKING:
    from engine.decode.loaded import LoadedModel
    from engine.decode.logit_rules import LogitRules
    from engine.decode.stats import GenerationStats


@dataclass
class DecodeState:
    """Everything one generation carries from step to step."""

    lm: LoadedModel
    params: SamplingParams
    cache: object  # the target's cache holding the committed tokens (engine/decode/target.py)
    ids: list[int]  # prompt + generated tokens; ids[-1] is pending (chosen, not yet cached)
    prompt_len: int
    generator: torch.Generator
    hidden: torch.Tensor | None = None  # (H,) final hidden state that predicted ids[-1]
    # the reply's bias, penalties and grammar (engine/decode/logit_rules.py); None: none apply
    rules: LogitRules | None = None

    @property
    def target(self):
        """How steps run the model (engine/decode/target.py)."""
        return self.lm.target

    @property
    def cached(self) -> int:
        """Tokens in the cache: all of ids but the pending one."""
        return len(self.ids) - 1

    @property
    def room(self) -> int:
        """The most draft tokens worth proposing now: the step's own token must still fit
        the budget, and no draft may sit past the model's last position."""
        generated = len(self.ids) - self.prompt_len  # the pending token included
        return max(0, min(self.params.max_new_tokens - generated - 1,
                          self.lm.context_len - self.cached - 1))


@dataclass
class Draft:
    """Candidate tokens for one step, as a tree rooted at the pending token."""

    tokens: list[int]  # node tokens; node 0 is the pending token (chosen, not yet cached)
    children: list[list[int]]  # children[i]: node i's children in the drafter's preference order
    depths: list[int]  # node depth below the root, i.e. its position offset
    tree_mask: torch.Tensor | None = None  # (n, n) bool, node i attends to node j; None = chain
    # (n - 1, V) q rows of a sampled chain; None = point mass
    draft_probs: torch.Tensor | None = None
    # each node's chance of being kept as its source estimates it (the root's 1.0); None
    # where the source does not say: what a composite counts when drafts join
    chances: list[float] | None = None

    @classmethod
    def chain(cls, root: int, drafted: list[int], draft_probs: torch.Tensor | None = None,
              chances: list[float] | None = None) -> Draft:
        """A linear draft: root -> drafted[0] -> drafted[1] -> ... (`chances`: the drafted
        nodes' chances of being kept, in order)."""
        n = len(drafted) + 1
        children = [[i + 1] for i in range(n - 1)] + [[]]
        return cls([root, *drafted], children, list(range(n)), None, draft_probs,
                   None if chances is None else [1.0, *chances])

    @property
    def size(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class DraftOffer:
    """What a source's session would draft this step, decided from the past only: its
    draft and how many of its tokens it expects kept. A composite picks and joins offers by
    expected tokens per unit of the measured step cost (engine.drafters.composite)."""

    kind: str  # what a step it drafts counts as ("copy", "medusa", ...)
    build: Callable[[int], Draft]  # k -> the draft of its k most likely nodes (k == size: all)
    # Each node's chance of being kept, most likely first: the k most likely nodes form a
    # draft (a node is never likelier than its parent). Sources that count what was kept
    # say it from their counts; trained ones from calibration, corrected by this reply.
    chances: tuple[float, ...] = ()
    # plain steps of the source's own work when it drafts (a trained source's heads), timed
    # here against the plain step; verifying the draft costs the step-cost curve on top
    overhead: float = 0.0
    # plain steps a whole round costs, timed here, for a source that verifies its own
    # drafts (Kangaroo runs the layers above its exit): it drafts all or nothing
    round_cost: float | None = None
    joins: bool = True  # False: verified alone (a copy in progress, a round of own layers)

    @property
    def size(self) -> int:
        """Draft nodes it offers (the root excluded)."""
        return len(self.chances)


class Session:
    """One reply's drafting (made by Drafter.start, advanced by every step). Plain decoding:
    it proposes nothing, so every step is one token from the full model."""

    wants_hidden = False  # True when it reads the final hidden states of what it scores

    def propose(self, state: DecodeState) -> Draft:
        return Draft.chain(state.ids[-1], [])

    def offer(self, state: DecodeState) -> DraftOffer | None:
        """What it would draft this step in a composite (None: nothing)."""
        return None

    def score(self, state: DecodeState, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the full model over the draft's nodes: ((n, V) logits, (n, H) last hidden)."""
        return forward_nodes(state, draft, want_hidden=self.wants_hidden)

    def commit(self, state: DecodeState, draft: Draft, path: list[int]) -> None:
        """Keep the cache entries of the root and the accepted nodes."""
        state.target.keep_path(state.cache, state.cached, [0, *path])

    def observe(self, state: DecodeState, layers: tuple[torch.Tensor, ...] | None,
                path: list[int], offered: list[int]) -> None:
        """In a composite, a step was verified and `path` kept (the cache already holds it).
        layers: every layer's (1, n, H) states over the draft when the composite ran the
        whole model with them, else None; offered: the draft's nodes this session offered."""

    def finish(self, stats: GenerationStats | None) -> None:
        """Called once when the reply ends (finished, stopped or cancelled)."""


class Drafter:
    """How a method drafts for a loaded model: weights, calibration and its verdict,
    shareable between replies (every reply's own state lives in the Session that `start`
    returns). This one is plain decoding."""

    name = "off"
    drafts = False  # True when it proposes tokens: the loop then checks the cache can drop them
    wants_hidden = False  # True when its sessions read hidden states (state.hidden, prefill)
    verifies = False  # True when its sessions verify their own drafts (Kangaroo's layers
    # above the early exit); a composite then routes such a step to that session
    notice = ""  # one line for the user when it decodes plainly after all (does not pay here)
    retimed_speedup: float | None = None  # the speedup estimated at load, when re-timed here
    speedup: float | None = None  # measured speed over plain decoding (calibration, re-timed)

    @property
    def pays_off(self) -> bool:
        """False when the drafter was measured no faster than plain decoding here (it then
        decodes plainly, and Auto leaves it out)."""
        return True

    def start(self, state: DecodeState, prefill: tuple[torch.Tensor, ...] | None) -> Session:
        """A session for one reply, once prefill ran. prefill: every layer's (1, P, H) states
        over the prompt (embeddings first) when the drafter wants hidden states, else None;
        state.hidden then holds the state that predicted the pending token."""
        return Session()

    def used(self) -> str:
        """The method a reply drafted with, as stored and shown: its name, or for a drafter
        that chooses among others, "<name>:<choice>"."""
        return self.name

    def reason(self, stats: GenerationStats | None = None) -> str:
        """One line for the readout on how it drafts (and how the reply `stats` did)."""
        return ""


def forward_nodes(
    state: DecodeState, draft: Draft, want_hidden: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target-model forward over all draft nodes, appended to the cache: (n, V) logits
    and, if wanted, the (n, H) final hidden states."""
    logits, hidden = forward_layers(state, draft, want_hidden)
    return logits, hidden[-1][0] if want_hidden else None


def forward_layers(
    state: DecodeState, draft: Draft, want_hidden: bool
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """One target-model forward over all draft nodes, appended to the cache: (n, V) logits
    and, if wanted, every layer's (1, n, H) states (embeddings first, final normed last).
    A tree is verified in one pass (each node sees the cache and its ancestors)."""
    tree = draft.tree_mask is not None
    out = state.target.forward(state.cache, draft.tokens, state.cached,
                               draft.depths if tree else None, draft.tree_mask,
                               states=want_hidden)
    return out.logits, out.states


def start_session(drafter: Drafter, state: DecodeState,
                  states: tuple[torch.Tensor, ...] | None) -> Session:
    """The drafter's session for the reply in `state` (which holds the pending token),
    handed the prefill's every-layer `states` (computed when drafter.wants_hidden)."""
    if states is not None:
        state.hidden = states[-1][0, -1]
    return drafter.start(state, states)
