"""Medusa-1: K heads on the final hidden state guess the tokens 2..K+1 ahead; their top-k
guesses fill a calibrated sparse tree that the full model verifies in one forward pass.

Head k is the residual block h + SiLU(W_k h + b_k) (W_k, b_k zero-initialised, so an
untrained head repeats the model's own next-token prediction) read through the model's
frozen LM head, or optionally through a head-owned vocabulary projection initialised from
it. Verification, acceptance and the cache update are the decode loop's shared code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.drafters.base import Draft, Drafter
from engine.errors import AcceleratorError, QuickdraftError
from engine.tree import TreeBuffers, build_tree

WEIGHT, BIAS, VOCAB = "heads.weight", "heads.bias", "heads.vocab"


@dataclass(frozen=True)
class MedusaSettings:
    """Shape of the heads (stored in the checkpoint's settings)."""

    num_heads: int = 4  # K: head k guesses the token k + 1 positions after the hidden state
    own_vocab: bool = False  # True: each head has its own (V, H) projection (large!)


class MedusaHeads(nn.Module):
    """K residual blocks over the final hidden state, evaluated together."""

    def __init__(self, hidden_size: int, settings: MedusaSettings, vocab_init: torch.Tensor | None = None):
        super().__init__()
        k, h = settings.num_heads, hidden_size
        self.settings = settings
        self.weight = nn.Parameter(torch.zeros(k, h, h))  # (K, H_out, H_in), zero: starts as identity
        self.bias = nn.Parameter(torch.zeros(k, h))  # (K, H)
        self.vocab = None
        if settings.own_vocab:
            if vocab_init is None:
                raise AcceleratorError("own-vocabulary Medusa heads need a (V, H) projection to start from")
            # (K, V, H): every head starts as a copy of vocab_init (the model's LM head).
            self.vocab = nn.Parameter(vocab_init.detach().float().unsqueeze(0).repeat(k, 1, 1))

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) final hidden states -> (..., K, H) per-head states h + SiLU(W_k h + b_k)."""
        z = torch.einsum("...i,koi->...ko", hidden, self.weight) + self.bias
        return hidden.unsqueeze(-2) + nn.functional.silu(z)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """(..., H) -> (..., K, V): all heads' logits in one batched matmul."""
        states = self.transform(hidden.to(self.weight.dtype))
        if self.vocab is None:
            return lm_head(states.to(lm_head.weight.dtype))
        return torch.einsum("...kh,kvh->...kv", states, self.vocab)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Weights for the checkpoint (safetensors names)."""
        out = {WEIGHT: self.weight.detach(), BIAS: self.bias.detach()}
        if self.vocab is not None:
            out[VOCAB] = self.vocab.detach()
        return out


def heads_from_tensors(tensors: dict[str, torch.Tensor], hidden_size: int, vocab_size: int,
                       settings: MedusaSettings) -> MedusaHeads:
    """Rebuild heads from checkpoint tensors, refusing shapes that do not fit the model."""
    k, h = settings.num_heads, hidden_size
    expected = {WEIGHT: (k, h, h), BIAS: (k, h)}
    if settings.own_vocab:
        expected[VOCAB] = (k, vocab_size, h)
    for name, shape in expected.items():
        got = tensors.get(name)
        if got is None or tuple(got.shape) != shape:
            found = "missing" if got is None else f"shape {tuple(got.shape)}"
            raise AcceleratorError(
                f"the Medusa weights do not fit this model ({name}: {found}, expected {shape}); "
                "run: python launcher.py train --method medusa"
            )
    vocab_init = tensors[VOCAB][0] if settings.own_vocab else None
    heads = MedusaHeads(h, settings, vocab_init)
    heads.load_state_dict({name.split(".", 1)[1]: tensors[name] for name in expected})
    return heads


class MedusaDrafter(Drafter):
    """Proposes the calibrated tree filled with the heads' top-k tokens."""

    name = "medusa"
    wants_hidden = True

    def __init__(self, lm, heads: MedusaHeads, tree: TreeBuffers):
        if tree.depth > heads.settings.num_heads:
            raise AcceleratorError(
                f"the Medusa tree needs {tree.depth} heads but the checkpoint has {heads.settings.num_heads}"
            )
        self.heads = heads.to(lm.device, lm.dtype).eval().requires_grad_(False)
        self.lm_head = lm.model.get_output_embeddings()
        self.tree = tree
        # Gather indices live on the heads' device once; only token values change per step.
        self._slots = (tree.node_heads.to(lm.device), tree.node_ranks.to(lm.device))

    @classmethod
    def from_checkpoint(cls, lm, ckpt) -> MedusaDrafter:
        """Build from a validated engine.accelerators.Checkpoint."""
        s = ckpt.info.get("settings", {})
        try:
            settings = MedusaSettings(int(s["num_heads"]), bool(s.get("own_vocab", False)))
            choices = [tuple(c) for c in s["tree"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise AcceleratorError(
                f"the Medusa accelerator in {ckpt.folder} has unreadable settings ({exc}); "
                "run: python launcher.py train --method medusa"
            ) from exc
        lm_head = lm.model.get_output_embeddings()
        heads = heads_from_tensors(ckpt.tensors, int(lm.model.config.hidden_size),
                                   int(lm_head.weight.shape[0]), settings)
        try:
            tree = build_tree(choices, settings.num_heads)
        except QuickdraftError as exc:
            raise AcceleratorError(f"the Medusa tree in {ckpt.folder} is invalid: {exc}; "
                                   "run: python launcher.py train --method medusa") from exc
        return cls(lm, heads, tree)

    @property
    def pays(self) -> bool:
        """False when calibration stored an empty tree: no tree beat plain decoding here."""
        return self.tree.size > 1

    def propose(self, state) -> Draft:
        """Heads read state.hidden (the state that predicted the pending token) -> tree."""
        root = state.ids[-1]
        if self.tree.size == 1:  # calibration found no tree that pays: plain decoding
            return Draft.chain(root, [])
        logits = self.heads.logits(state.hidden, self.lm_head)  # (K, V)
        top = torch.topk(logits, self.tree.top_k, dim=-1).indices  # (K, top_k)
        drafted = top[self._slots].tolist()  # (n - 1,) node tokens in node order
        t = self.tree
        return Draft([root, *drafted], t.children, t.depths, t.mask)
