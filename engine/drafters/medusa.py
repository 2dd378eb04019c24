"""Medusa-1's drafter: the heads (engine/drafters/medusa_heads.py) guess the tokens
2..K+1 ahead from the final hidden state; their top-k guesses fill a candidate tree whose
nodes carry the chance of being kept that calibration counted on held-out answers, and
each step the tree is cut to the nodes that pay at the step costs and a drafted step's
overhead (the heads, the tree's mask, the states kept) timed here, then verified by the full
model in one forward pass.
Verification, acceptance and the cache update are the decode loop's shared code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.decode.drafter import Draft, Drafter, DraftOffer, Session
from engine.decode.timing import StepCost, step_cost
from engine.decode.tree import (
    TreeBuffers,
    build_tree,
    expected_tokens,
    greedy_tree,
    marginal_accuracies,
)
from engine.drafters.accelerators import check_format
from engine.drafters.composite import alone
from engine.drafters.medusa_heads import (
    FIX,
    FORMAT,
    MedusaHeads,
    MedusaSettings,
    heads_from_tensors,
    pending_inputs,
)
from engine.drafters.payoff import not_paying_notice, step_overhead
from engine.errors import AcceleratorError, QuickdraftError
from engine.weights import quant

# Nodes of the candidate tree an older checkpoint (accuracies only) is read into.
CANDIDATES = 32
# How many tokens' worth the calibrated chances count for against a reply's own counts.
PRIOR_TOKENS = 8.0
# Nodes a drafted step is timed with: the heads' work and the rest of a drafted step hardly
# depend on the count, and verifying one node is where the curve's share is least noisy (on
# a 2-core EPYC a whole step of 1, 2 and 4 nodes cost 0.18-0.27 plain steps past the curve,
# of 8 anywhere from 0 to 0.27).
TIMED_NODES = 1


class MedusaDrafter(Drafter):
    """Proposes a tree filled with the heads' top-k tokens: each step the candidate tree cut
    to the nodes that pay, by each node's chance of being kept (measured on held-out answers
    when the heads were trained, corrected by what this reply kept) against the step costs
    and a drafted step's overhead timed here."""

    name = "medusa"
    drafts = True
    wants_hidden = True

    def __init__(self, lm, heads: MedusaHeads, tree: TreeBuffers,
                 chances: Sequence[float] | None = None, overhead: float | None = None):
        """tree: the candidate tree; chances: per non-root node of it (in its order) the
        chance of being kept, as calibration measured it; None: never measured, so alone it
        drafts the whole tree every step and in a composite it offers nothing. overhead:
        plain steps the heads cost per step where known; None: timed here at first use."""
        if tree.depth > heads.settings.num_heads:
            raise AcceleratorError(
                f"the Medusa tree needs {tree.depth} heads but the checkpoint has "
                f"{heads.settings.num_heads}"
            )
        self.lm = lm
        self.heads = heads.to(lm.device, lm.dtype).eval().requires_grad_(False)
        head = lm.model.get_output_embeddings()
        # A low-bit LM head scores the heads' states itself where they read all of it: its
        # dense rows would be a full-precision copy of the head (56 MB on the bundled
        # model), and its kernel takes the K rows at once.
        self._head = (head if isinstance(head, quant.LowBitLinear) and heads.vocab is None
                      and heads.vocab_ids is None else None)
        # (V', H) LM-head rows the heads read otherwise: a small copy for a draft vocabulary
        # (a low-bit head's rows read from its codes, without expanding the rest).
        rows = heads.vocab_ids is not None and isinstance(head, quant.LowBitLinear)
        self._projection = (None if self._head is not None
                            else head.rows(heads.vocab_ids).to(lm.dtype) if rows
                            else heads.project(head.weight.detach()))
        # The input embeddings the pending token is looked up in (the model's own module).
        self._embedding = (lm.model.get_input_embeddings()
                           if heads.settings.pending_rank else None)
        self.tree = tree
        # The candidate tree's nodes, most likely first, with their chances (their
        # ancestors are likelier, so any first k of them form a tree).
        order = [] if chances is None else sorted(range(1, tree.size),
                                                  key=lambda n: -chances[n - 1])
        self.ranked = [tree.choices[n] for n in order]
        self.chances = None if chances is None else [float(chances[n - 1]) for n in order]
        self._cuts: dict[int, tuple[TreeBuffers, list[float], tuple]] = {}
        # plain steps of the heads, by step kind (timed once per kind unless given)
        self._overhead: dict[str, float] = {}
        self._fixed_overhead = overhead

    @classmethod
    def from_checkpoint(cls, lm, ckpt) -> MedusaDrafter:
        """Build from a validated engine.drafters.accelerators.Checkpoint."""
        s = ckpt.info.get("settings", {})
        check_format(s.get("format", 1), FORMAT, "medusa", ckpt.folder, "heads")
        try:
            settings = MedusaSettings(int(s["num_heads"]), bool(s.get("own_vocab", False)),
                                      int(s["pending_rank"]))
            choices, chances = stored_candidates(s)
            if settings.num_heads < 1:
                raise ValueError(f"num_heads {settings.num_heads} is not a positive count")
        except (KeyError, TypeError, ValueError) as exc:
            raise AcceleratorError(
                f"the Medusa accelerator in {ckpt.folder} has unreadable settings ({exc}); {FIX}"
            ) from exc
        lm_head = lm.model.get_output_embeddings()
        heads = heads_from_tensors(
            ckpt.tensors, int(lm.model.config.hidden_size), int(lm_head.weight.shape[0]), settings
        )
        try:
            tree = build_tree(choices, settings.num_heads)
        except QuickdraftError as exc:
            raise AcceleratorError(
                f"the Medusa tree in {ckpt.folder} is invalid: {exc}; {FIX}"
            ) from exc
        chances = [chances[tuple(c)] for c in tree.choices[1:]]
        drafter = cls(lm, heads, tree, chances)
        if not drafter.pays_off:
            drafter.notice = not_paying_notice("Medusa", lm, drafter.speedup or 0.0)
        return drafter

    def overhead(self) -> float:
        """Plain steps a drafted step costs here beyond verifying its tokens (the heads, the
        tree's mask, the states kept, the commit), timed as a whole step against the plain
        step of the step kind running now (once per kind)."""
        if self._fixed_overhead is not None:
            return self._fixed_overhead
        kind = self.lm.target.name
        if kind not in self._overhead:
            k = min(len(self.ranked), TIMED_NODES)
            self._overhead[kind] = step_overhead(self.lm, _FixedCut(self, k), k + 1)
        return self._overhead[kind]

    def value(self, chances: Sequence[float], cost: StepCost,
              overhead: float | None = None) -> tuple[int, float]:
        """(nodes, expected tokens per plain step of cost) of the best cut of the tree at
        these node chances (most likely first), at `overhead` (None: the one timed here)."""
        spent = self.overhead() if overhead is None else overhead
        return alone(DraftOffer("medusa", self.draft, tuple(chances), spent), cost)

    @property
    def speedup(self) -> float | None:
        """Estimated speed over plain decoding here: the best cut of the candidate tree at
        the chances calibration measured, the step costs and a drafted step's overhead timed
        here."""
        if not self.chances:
            return None
        return self.value(self.chances, step_cost(self.lm))[1]

    @property
    def retimed_speedup(self) -> float | None:
        """The estimate made here at load (see speedup)."""
        return self.speedup

    @property
    def pays_off(self) -> bool:
        """Whether some cut of the tree is estimated faster than plain decoding here (a
        drafter never measured drafts its whole tree alone, as asked; an empty tree never)."""
        if self.tree.size <= 1:
            return False
        return self.chances is None or (self.speedup or 0.0) > 1.0

    def start(self, state, prefill) -> MedusaSession:
        return MedusaSession(self)

    def cut(self, k: int) -> tuple[TreeBuffers, list[float], tuple]:
        """The tree of the k most likely nodes, its nodes' calibrated chances (root 1.0) and
        the heads' (head, rank) slots per node, built once per k."""
        if k not in self._cuts:
            tree = build_tree(self.ranked[:k], self.heads.settings.num_heads)
            chance_of = dict(zip(self.ranked, self.chances, strict=True))
            self._cuts[k] = (tree, [1.0, *(chance_of[c] for c in tree.choices[1:])],
                             self._slots(tree))
        return self._cuts[k]

    def _slots(self, tree: TreeBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' (head, rank) slot of each node of `tree`, on the heads' device."""
        device = self.heads.weight.device
        return tree.node_heads.to(device), tree.node_ranks.to(device)

    def draft(self, state, k: int | None = None, scale: float = 1.0) -> Draft:
        """Heads read state.hidden (the state that predicted the pending token) and that
        token (the root) -> the tree of the k most likely nodes (None: the whole candidate
        tree), its chances scaled by `scale` (this reply's correction).

        Where fewer tokens than the tree's depth fit the budget or the context (the last
        steps of a reply), the heads' top-1 guesses for the room left, as a chain."""
        root = state.ids[-1]
        if k is None or not self.chances:
            t, chances, slots = self.tree, None, self._slots(self.tree)
        else:
            t, chances, slots = self.cut(k)
        if t.size == 1:
            return Draft.chain(root, [])
        pending = None if self._embedding is None else pending_inputs(
            self._embedding, torch.tensor(root, device=slots[0].device))
        # Only the heads the tree reaches: each head's logits cost a row of the LM head,
        # a fifth of the bundled model's weights.
        logits = self.heads.logits(state.hidden, pending, self._projection, t.depth,
                                   self._head)  # (depth, V')
        scaled = None if chances is None else [1.0, *(min(1.0, scale * c) for c in chances[1:])]
        if state.room < t.depth:
            tokens = self.heads.tokens(logits[:state.room].argmax(-1)).tolist()
            return Draft.chain(root, tokens,
                               chances=None if scaled is None else scaled[1:len(tokens) + 1])
        top = torch.topk(logits, t.top_k, dim=-1).indices  # (K, top_k) columns
        drafted = self.heads.tokens(top[slots]).tolist()  # (n - 1,) node tokens
        return Draft([root, *drafted], t.children, t.depths, t.mask, chances=scaled)


class MedusaSession(Session):
    """A reply drafting with the heads: they read the state the loop keeps (state.hidden);
    the session counts how many of the heads' nodes this reply kept against the chances it
    drafted them at, and scales the calibrated chances by that."""

    wants_hidden = True

    def __init__(self, drafter: MedusaDrafter) -> None:
        self.drafter = drafter
        self.kept = 0.0  # the heads' nodes kept in this reply
        self.expected = 0.0  # their summed calibrated chances
        self._step = 0.0  # the summed chances of this step's draft (0: none built)
        self.plain = False  # no cut pays for the rest of this reply: it decodes plainly

    def scale(self) -> float:
        """This reply's correction of the calibrated chances: kept / expected, starting
        from the calibration itself (PRIOR_TOKENS tokens' worth)."""
        return (PRIOR_TOKENS + self.kept) / (PRIOR_TOKENS + self.expected)

    def _build(self, state, k: int | None, scale: float) -> Draft:
        draft = self.drafter.draft(state, k, scale)
        # counted in calibration's own chances, so kept / expected is the correction itself
        self._step = sum(draft.chances[1:]) / scale if draft.chances else 0.0
        return draft

    def propose(self, state) -> Draft:
        d = self.drafter
        if not d.chances:
            return d.draft(state)
        if self.plain:
            return Draft.chain(state.ids[-1], [])
        scale = self.scale()
        k, value = d.value([min(1.0, scale * c) for c in d.chances],
                           step_cost(d.lm, state.params))
        if k == 0 or value <= 1.0:
            # Only drafted nodes move this reply's correction, and the step costs are fixed
            # once timed (a compiled step ready mid-reply is priced from the next reply):
            # no later step would pay either, so the rest of the reply decodes plainly,
            # without the final states the heads would read.
            self.plain, self.wants_hidden = True, False
            return Draft.chain(state.ids[-1], [])
        return self._build(state, k, scale)

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        super().commit(state, draft, path)
        self.observe(state, None, path, list(range(1, draft.size)))

    def offer(self, state) -> DraftOffer | None:
        """The candidate tree, each node at this reply's chance of being kept, with the
        heads' timed cost (nothing where the heads were never measured)."""
        d = self.drafter
        if not d.chances or state.room == 0:
            return None
        scale = self.scale()
        return DraftOffer("medusa", lambda k: self._build(state, k, scale),
                          tuple(min(1.0, scale * c) for c in d.chances), d.overhead())

    def observe(self, state, layers, path: list[int], offered: list[int]) -> None:
        """Count the heads' nodes this step kept against the chances they were drafted at."""
        if self._step and offered:
            self.kept += sum(node in path for node in offered)
            self.expected += self._step
        self._step = 0.0


class _FixedCut(Drafter):
    """The heads drafting their k most likely nodes every step (timing a drafted step)."""

    wants_hidden = True

    def __init__(self, drafter: MedusaDrafter, k: int) -> None:
        self.drafter, self.k = drafter, k

    def start(self, state, prefill) -> Session:
        return _FixedCutSession(self.drafter, self.k)


class _FixedCutSession(MedusaSession):
    def __init__(self, drafter: MedusaDrafter, k: int) -> None:
        super().__init__(drafter)
        self.k = k

    def propose(self, state) -> Draft:
        d = self.drafter
        d.value(d.chances, step_cost(d.lm), 0.0)  # a step's choice of its cut, timed with it
        return self._build(state, self.k, 1.0)


def stored_candidates(settings: dict) -> tuple[list[tuple[int, ...]], dict]:
    """The candidate tree and each node's chance of being kept, from a checkpoint's
    settings: as calibration measured them on held-out answers ("candidates": [[choice,
    chance], ...]), or (an older checkpoint) the greedy tree of its per-head accuracies with
    independent heads, scaled by its measured-to-estimated ratio. Raises ValueError or
    TypeError on malformed settings."""
    if "candidates" in settings:
        pairs = [(tuple(int(r) for r in c), float(p)) for c, p in settings["candidates"]]
    else:
        marginal = marginal_accuracies([[float(a) for a in row]
                                        for row in settings.get("accuracies", [])])
        ratio = float(settings.get("estimate_ratio", 1.0))
        pairs = [(c, min(1.0, ratio * (expected_tokens([c], marginal) - 1.0)))
                 for c in greedy_tree(marginal, CANDIDATES)]
    for choice, chance in pairs:
        if not 0.0 <= chance <= 1.0:
            raise ValueError(f"node {list(choice)} has a chance of {chance}")
    return [c for c, _p in pairs], dict(pairs)
