"""Medusa-1's heads: K heads on the final hidden state guess the tokens 2..K+1 ahead; their top-k
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import AcceleratorError

WEIGHT, BIAS, VOCAB, VOCAB_IDS = "heads.weight", "heads.bias", "heads.vocab", "heads.vocab_ids"
TOKEN_DOWN, TOKEN_UP = "heads.token_down", "heads.token_up"
FIX = "run: python launcher.py train --method medusa"
# Checkpoint layout of the heads (settings["format"]); 2: heads may read the pending token.
FORMAT = 2


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
    if ids is not None and (ids.dim() != 1 or ids.numel() == 0 or int(ids.max()) >= vocab_size):
        raise AcceleratorError(f"the Medusa draft vocabulary does not fit this model; {FIX}")
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
                f"expected {shape}); {FIX}"
            )
    init = torch.zeros(vocab_size, h) if settings.own_vocab else None  # overwritten below
    heads = MedusaHeads(h, settings, ids, init)
    names = [*expected, *([VOCAB_IDS] if ids is not None else [])]
    heads.load_state_dict({n.split(".", 1)[1]: tensors[n] for n in names})
    return heads
