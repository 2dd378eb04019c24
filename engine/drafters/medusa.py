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

from dataclasses import dataclass

import torch
from torch import nn

from engine import quant
from engine.accelerators import check_format, measured_speedup
from engine.drafters.base import Draft, Drafter, Offer, Session
from engine.drafters.payoff import (
    PAY_MARGIN,
    Payoff,
    not_paying_notice,
    round_seconds,
    timed_elsewhere,
)
from engine.errors import AcceleratorError, QuickdraftError
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
# Loading in a dtype or on a device calibration did not time (e.g. trained in bf16, loaded
# in fp32): the tree budgets re-timed at load (engine.drafters.payoff decides what pays).
RETIME_BUDGETS = (1, 2, 4, 8, 16)


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
    """Proposes the calibrated tree filled with the heads' top-k tokens."""

    name = "medusa"
    drafts = True
    wants_hidden = True

    def __init__(self, lm, heads: MedusaHeads, tree: TreeBuffers,
                 retimed: Payoff | None = None, speedup: float | None = None):
        if tree.depth > heads.settings.num_heads:
            raise AcceleratorError(
                f"the Medusa tree needs {tree.depth} heads but the checkpoint has "
                f"{heads.settings.num_heads}"
            )
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
        # The best tree's estimate when it was re-timed at load (uncalibrated dtype or
        # device); None: the calibrated tree, as stored.
        self.retimed = retimed
        self.retimed_speedup = None if retimed is None else retimed.speedup
        # The tree's measured speed over plain decoding (re-timed here, else calibration's).
        self.speedup = self.retimed_speedup or speedup
        self.notice = "" if retimed is None or retimed.pays else not_paying_notice(
            "Medusa", lm, retimed.speedup)
        # Gather indices live on the heads' device once; only token values change per step.
        self._slots = (tree.node_heads.to(lm.device), tree.node_ranks.to(lm.device))

    @classmethod
    def from_checkpoint(cls, lm, ckpt) -> MedusaDrafter:
        """Build from a validated engine.accelerators.Checkpoint.

        The stored tree was timed in the dtype training ran in; loaded in another (bf16 heads
        on an fp32 or 4-bit model), the tree is re-timed here from the stored accuracies."""
        s = ckpt.info.get("settings", {})
        check_format(s.get("format", 1), FORMAT, "medusa", ckpt.folder, "heads")
        try:
            settings = MedusaSettings(int(s["num_heads"]), bool(s.get("own_vocab", False)),
                                      int(s["pending_rank"]))
            choices = [tuple(c) for c in s["tree"]]
            accuracies = [[float(a) for a in row] for row in s.get("accuracies", [])]
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
        retimed = None
        if timed_elsewhere(s, lm) and accuracies:
            choices, retimed = retimed_tree(lm, heads, accuracies,
                                            float(s.get("estimate_ratio", 1.0)))
        try:
            tree = build_tree(choices, settings.num_heads)
        except QuickdraftError as exc:
            raise AcceleratorError(
                f"the Medusa tree in {ckpt.folder} is invalid: {exc}; {FIX}"
            ) from exc
        return cls(lm, heads, tree, retimed, measured_speedup(ckpt.metrics))

    @property
    def pays(self) -> bool:
        """False when calibration stored an empty tree: no tree beat plain decoding here."""
        return self.tree.size > 1

    def start(self, state, prefill) -> MedusaSession:
        return MedusaSession(self)

    def draft(self, state) -> Draft:
        """Heads read state.hidden (the state that predicted the pending token) and that
        token (the root) -> tree.

        Where fewer tokens than the tree's depth fit the budget or the context (the last
        steps of a reply), the heads' top-1 guesses for the room left, as a chain."""
        root, t = state.ids[-1], self.tree
        if t.size == 1:  # calibration found no tree that pays: plain decoding
            return Draft.chain(root, [])
        pending = None if self._embedding is None else pending_inputs(
            self._embedding, torch.tensor(root, device=self._slots[0].device))
        # Only the heads the tree reaches: each head's logits cost a row of the LM head,
        # a fifth of the bundled model's weights.
        logits = self.heads.logits(state.hidden, pending, self._projection, t.depth,
                                   self._head)  # (depth, V')
        if state.room < t.depth:
            return Draft.chain(root, self.heads.tokens(logits[:state.room].argmax(-1)).tolist())
        top = torch.topk(logits, t.top_k, dim=-1).indices  # (K, top_k) columns
        drafted = self.heads.tokens(top[self._slots]).tolist()  # (n - 1,) node tokens
        return Draft([root, *drafted], t.children, t.depths, t.mask)


class MedusaSession(Session):
    """A reply drafting with the heads: they read the state the loop keeps (state.hidden),
    so the session holds nothing of its own."""

    wants_hidden = True

    def __init__(self, drafter: MedusaDrafter) -> None:
        self.drafter = drafter

    def propose(self, state) -> Draft:
        return self.drafter.draft(state)

    def offer(self, state) -> Offer | None:
        """The calibrated tree, valued at its measured speedup (an accelerator whose speed
        was never measured is taken to just pay)."""
        d = self.drafter
        if d.tree.size == 1:
            return None
        size = d.tree.size - 1 if state.room >= d.tree.depth else state.room
        return Offer("medusa", size, lambda _k: d.draft(state),
                     speedup=d.speedup or PAY_MARGIN)


def retimed_tree(lm, heads: MedusaHeads, topk_acc: list[list[float]],
                 estimate_ratio: float = 1.0, repeats: int = 3) -> tuple[list, Payoff]:
    """The greedy tree with the best estimated speedup from step times measured now, and
    that estimate; no tree ([]) when none pays, so a re-timed drafter is never expected to
    be slower. Expected tokens per step come from the stored held-out accuracies, scaled by
    `estimate_ratio` (measured / estimated tokens per step of the tree calibration chose:
    the independence assumption over-counts deep nodes)."""
    marginal = marginal_accuracies(topk_acc)
    plain = tree_step_seconds(lm, heads, [], repeats=repeats)
    best, best_payoff = [], Payoff(1.0, plain, plain)
    for budget in RETIME_BUDGETS:
        choices = greedy_tree(marginal, budget)
        tokens = 1 + (expected_tokens(choices, marginal) - 1) * estimate_ratio
        payoff = Payoff(tokens, plain, tree_step_seconds(lm, heads, choices, repeats=repeats))
        if payoff.speedup > best_payoff.speedup:
            best, best_payoff = choices, payoff
    return (best, best_payoff) if best_payoff.pays else ([], best_payoff)


def tree_step_seconds(lm, heads: MedusaHeads, choices, ids: list[int] | None = None,
                      repeats: int = 3) -> float:
    """Median seconds of a decode step drafting the tree `choices` ([]: a plain step, whose
    heads still run) after the prompt `ids` (engine.drafters.payoff.round_seconds)."""
    tree = build_tree(choices, heads.settings.num_heads)
    return round_seconds(lm, MedusaDrafter(lm, heads, tree), ids, repeats)
