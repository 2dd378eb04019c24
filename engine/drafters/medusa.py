"""Medusa-1: K heads on the final hidden state guess the tokens 2..K+1 ahead; their top-k
guesses fill a calibrated sparse tree that the full model verifies in one forward pass.

Head k is the residual block h + SiLU(W_k h + A_k B e + b_k) read through the model's frozen
LM head, or optionally through a head-owned vocabulary projection initialised from it.
h is the final state that predicted the pending token (the tree's root, already chosen
when the heads run) and e that token's input embedding (unit RMS), so head 1 guesses the
token after a known token instead of averaging over every token the model might pick.
B (r x H, shared) and A_k (H x r) keep the token path low-rank: full (H x H) maps per head
would double the heads' memory. Heads with r = 0 read h alone. W_k, A_k, b_k start at
zero (B at random, or nothing would train it): an untrained head repeats the model's own
next-token prediction.
Verification, acceptance and the cache update are the decode loop's shared code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine import quant
from engine.accelerators import check_format
from engine.drafters.base import Draft, Drafter, Offer, Session
from engine.drafters.composite import alone
from engine.drafters.payoff import not_paying_notice, work_ratio
from engine.errors import AcceleratorError, QuickdraftError
from engine.timing import StepCost, step_cost
from engine.tree import (
    TreeBuffers,
    build_tree,
    expected_tokens,
    greedy_tree,
    marginal_accuracies,
)

WEIGHT, BIAS, VOCAB, VOCAB_IDS = "heads.weight", "heads.bias", "heads.vocab", "heads.vocab_ids"
TOKEN_DOWN, TOKEN_UP = "heads.token_down", "heads.token_up"
FIX = "run: python launcher.py train --method medusa"
# Checkpoint layout of the heads (settings["format"]); 2: heads may read the pending token.
FORMAT = 2
# Nodes of the candidate tree an older checkpoint (accuracies only) is read into.
CANDIDATES = 32
# How many tokens' worth the calibrated chances count for against a reply's own counts.
PRIOR_TOKENS = 8.0
# Nodes the heads' cost is timed drafting (their work hardly depends on the count).
HEADS_TIMED_NODES = 8


@dataclass(frozen=True)
class MedusaSettings:
    """Shape of the heads (stored in the checkpoint's settings)."""

    num_heads: int = 4  # K: head k guesses the token k + 1 positions after the hidden state
    own_vocab: bool = False  # True: each head has its own (V', H) projection (large!)
    pending_rank: int = 128  # r: rank of the pending token's path; 0 = hidden state only

    def to_json(self) -> dict:
        return {"format": FORMAT, "num_heads": self.num_heads, "own_vocab": self.own_vocab,
                "pending_rank": self.pending_rank}


def pending_inputs(embedding: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Input embeddings of the pending tokens, scaled to unit RMS: the model's embedding
    module and (...,) ids on its device -> (..., H) float32. Families scale their tables
    differently (Gemma multiplies by sqrt(H)), so the heads see one scale everywhere."""
    rows = embedding(tokens).float()
    return rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6)


class MedusaHeads(nn.Module):
    """K residual blocks over the final hidden state, evaluated together.

    The heads may be limited to a draft vocabulary of V' token ids (vocab_ids): reading
    only those rows of the LM head makes proposing several times cheaper on small models,
    whose LM head is a large share of the weights. vocab_ids None = the whole vocabulary.
    """

    def __init__(
        self,
        hidden_size: int,
        settings: MedusaSettings,
        vocab_ids: torch.Tensor | None = None,
        vocab_init: torch.Tensor | None = None,
    ):
        super().__init__()
        k, h = settings.num_heads, hidden_size
        self.settings = settings
        self.weight = nn.Parameter(torch.zeros(k, h, h))  # (K, H_out, H_in); 0: starts as h
        self.bias = nn.Parameter(torch.zeros(k, h))  # (K, H)
        self.token_down = self.token_up = None
        if (r := settings.pending_rank) > 0:
            # (r, H_emb) shared, unit-variance outputs for a unit-RMS embedding; seeded so
            # that two runs on the same data train the same heads.
            down = torch.randn(r, h, generator=torch.Generator().manual_seed(0)) / h**0.5
            self.token_down = nn.Parameter(down)
            self.token_up = nn.Parameter(torch.zeros(k, h, r))  # (K, H_out, r); 0: starts as h
        self.register_buffer("vocab_ids", None if vocab_ids is None else vocab_ids.long())
        self.vocab = None
        if settings.own_vocab:
            if vocab_init is None:
                raise AcceleratorError(
                    "own-vocabulary Medusa heads need a projection to start from"
                )
            # (K, V', H): every head starts as a copy of the LM head's rows for its vocabulary.
            init = self.project(vocab_init.detach().float())
            self.vocab = nn.Parameter(init.unsqueeze(0).repeat(k, 1, 1))

    def transform(self, hidden: torch.Tensor, pending: torch.Tensor | None,
                  count: int | None = None) -> torch.Tensor:
        """(..., H) final hidden states and (..., H) pending_inputs (None for heads that
        do not read them) -> (..., K, H) per-head states h + SiLU(W_k h + A_k B e + b_k)
        (of the first `count` heads only, where given)."""
        z = torch.einsum("...i,koi->...ko", hidden, self.weight[:count]) + self.bias[:count]
        if self.token_up is not None:
            if pending is None:
                raise AcceleratorError("these Medusa heads read the pending token's embedding")
            low = pending.to(z.dtype) @ self.token_down.T  # (..., r)
            z = z + torch.einsum("...r,kor->...ko", low, self.token_up[:count])
        return hidden.unsqueeze(-2) + nn.functional.silu(z)

    def project(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The (V', H) rows of a (V, H) LM-head weight the heads read (no copy for all V)."""
        return lm_head_weight if self.vocab_ids is None else lm_head_weight[self.vocab_ids]

    def logits(self, hidden: torch.Tensor, pending: torch.Tensor | None,
               projection: torch.Tensor | None, count: int | None = None,
               head: nn.Module | None = None) -> torch.Tensor:
        """(..., H) states and pending_inputs -> (..., K, V') logits over the heads'
        vocabulary (of the first `count` heads only, where given), the heads in one
        batched matmul: over projection, (V', H) shared LM-head rows (see project), or
        through the LM-head module `head` itself."""
        states = self.transform(hidden.to(self.weight.dtype), pending, count)
        if head is not None:
            return head(states)
        if self.vocab is None:
            return states.to(projection.dtype) @ projection.T
        return torch.einsum("...kh,kvh->...kv", states, self.vocab[:count])

    def tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Columns of logits() -> token ids."""
        return columns if self.vocab_ids is None else self.vocab_ids[columns]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Weights for the checkpoint (safetensors names)."""
        out = {WEIGHT: self.weight.detach(), BIAS: self.bias.detach()}
        if self.token_up is not None:
            out[TOKEN_DOWN], out[TOKEN_UP] = self.token_down.detach(), self.token_up.detach()
        if self.vocab is not None:
            out[VOCAB] = self.vocab.detach()
        if self.vocab_ids is not None:
            out[VOCAB_IDS] = self.vocab_ids
        return out


def heads_from_tensors(
    tensors: dict[str, torch.Tensor], hidden_size: int, vocab_size: int, settings: MedusaSettings
) -> MedusaHeads:
    """Rebuild heads from checkpoint tensors, refusing shapes that do not fit the model."""
    k, h = settings.num_heads, hidden_size
    ids = tensors.get(VOCAB_IDS)
    fix = FIX
    if ids is not None and (ids.dim() != 1 or ids.numel() == 0 or int(ids.max()) >= vocab_size):
        raise AcceleratorError(f"the Medusa draft vocabulary does not fit this model; {fix}")
    expected = {WEIGHT: (k, h, h), BIAS: (k, h)}
    if (r := settings.pending_rank) > 0:
        expected[TOKEN_DOWN], expected[TOKEN_UP] = (r, h), (k, h, r)
    if settings.own_vocab:
        expected[VOCAB] = (k, vocab_size if ids is None else ids.numel(), h)
    for name, shape in expected.items():
        got = tensors.get(name)
        if got is None or tuple(got.shape) != shape:
            found = "missing" if got is None else f"shape {tuple(got.shape)}"
            raise AcceleratorError(
                f"the Medusa weights do not fit this model ({name}: {found}, "
                f"expected {shape}); {fix}"
            )
    init = torch.zeros(vocab_size, h) if settings.own_vocab else None  # overwritten below
    heads = MedusaHeads(h, settings, ids, init)
    names = [*expected, *([VOCAB_IDS] if ids is not None else [])]
    heads.load_state_dict({n.split(".", 1)[1]: tensors[n] for n in names})
    return heads


class MedusaDrafter(Drafter):
    """Proposes a tree filled with the heads' top-k tokens: each step the candidate tree cut
    to the nodes that pay, by each node's chance of being kept (measured on held-out answers
    when the heads were trained, corrected by what this reply kept) against the step costs
    and the heads' own cost timed here."""

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
        """Build from a validated engine.accelerators.Checkpoint."""
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
        if not drafter.pays:
            drafter.notice = not_paying_notice("Medusa", lm, drafter.speedup or 0.0)
        return drafter

    def overhead(self) -> float:
        """Plain steps the heads cost per drafted step here, timed against the plain step of
        the step kind running now (once per kind)."""
        if self._fixed_overhead is not None:
            return self._fixed_overhead
        kind = self.lm.target.name
        if kind not in self._overhead:
            self._overhead[kind] = work_ratio(self.lm, self._timed_heads)
        return self._overhead[kind]

    def _timed_heads(self, state) -> None:
        self.draft(state, min(len(self.ranked), HEADS_TIMED_NODES))

    def value(self, chances: Sequence[float], cost: StepCost) -> tuple[int, float]:
        """(nodes, expected tokens per plain step of cost) of the best cut of the tree at
        these node chances (most likely first)."""
        return alone(Offer("medusa", self.draft, tuple(chances), self.overhead()), cost)

    @property
    def speedup(self) -> float | None:
        """Estimated speed over plain decoding here: the best cut of the candidate tree at
        the chances calibration measured, the step costs and the heads' cost timed here."""
        if not self.chances:
            return None
        return self.value(self.chances, step_cost(self.lm))[1]

    @property
    def retimed_speedup(self) -> float | None:
        """The estimate made here at load (see speedup)."""
        return self.speedup

    @property
    def pays(self) -> bool:
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
            device = self._embedding_device()
            self._cuts[k] = (tree, [1.0, *(chance_of[c] for c in tree.choices[1:])],
                             (tree.node_heads.to(device), tree.node_ranks.to(device)))
        return self._cuts[k]

    def _embedding_device(self) -> torch.device:
        return self.heads.weight.device

    def draft(self, state, k: int | None = None, scale: float = 1.0) -> Draft:
        """Heads read state.hidden (the state that predicted the pending token) and that
        token (the root) -> the tree of the k most likely nodes (None: the whole candidate
        tree), its chances scaled by `scale` (this reply's correction).

        Where fewer tokens than the tree's depth fit the budget or the context (the last
        steps of a reply), the heads' top-1 guesses for the room left, as a chain."""
        root = state.ids[-1]
        if k is None or not self.chances:
            t, chances = self.tree, None
            slots = (t.node_heads.to(self._embedding_device()),
                     t.node_ranks.to(self._embedding_device()))
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
        if state.room < t.depth:
            tokens = self.heads.tokens(logits[:state.room].argmax(-1)).tolist()
            return Draft.chain(root, tokens, chances=None if chances is None else [
                min(1.0, scale * c) for c in chances[1:len(tokens) + 1]])
        top = torch.topk(logits, t.top_k, dim=-1).indices  # (K, top_k) columns
        drafted = self.heads.tokens(top[slots]).tolist()  # (n - 1,) node tokens
        scaled = None if chances is None else [1.0, *(min(1.0, scale * c) for c in chances[1:])]
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
        scale = self.scale()
        k, value = d.value([min(1.0, scale * c) for c in d.chances], step_cost(d.lm))
        if k == 0 or value <= 1.0:
            return Draft.chain(state.ids[-1], [])
        return self._build(state, k, scale)

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        super().commit(state, draft, path)
        self.observe(state, None, path, list(range(1, draft.size)))

    def offer(self, state) -> Offer | None:
        """The candidate tree, each node at this reply's chance of being kept, with the
        heads' timed cost (nothing where the heads were never measured)."""
        d = self.drafter
        if not d.chances or state.room == 0:
            return None
        scale = self.scale()
        return Offer("medusa", lambda k: self._build(state, k, scale),
                     tuple(min(1.0, scale * c) for c in d.chances), d.overhead())

    def observe(self, state, layers, path: list[int], mine: list[int]) -> None:
        """Count the heads' nodes this step kept against the chances they were drafted at."""
        if self._step and mine:
            self.kept += sum(node in path for node in mine)
            self.expected += self._step
        self._step = 0.0


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
