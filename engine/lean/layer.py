"""One decoder layer of the Llama family as a pure function over tensors: what the lean step
runs eagerly and what torch.compile turns into one compiled graph per step size.

Everything a layer reads is an argument (weights, the rotary rows of this step, the mask,
the layer's cache), so one compiled graph serves every layer of a model: the layers differ
only in their tensors. The family's variations (LeanSpec) are fixed when the function is
made, so they cost nothing per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn import functional as F
from transformers.activations import ACT2FN

from engine.lean.spec import LeanSpec
from engine.quant import lowbit_mm


class Lin(NamedTuple):
    """A linear layer's tensors. weight: (N, K) dense, or packed low-bit codes (Quickdraft's
    blocks, (N, bytes per row) uint8, or PyTorch's packings; engine.quant.lowbit_mm picks
    the kernel); scales: None for dense weights, the blocks' type (int64) or PyTorch's
    scales; wide: the low-bit weights' bf16 copy where one is kept for steps of many rows
    (engine/quant.py)."""

    weight: torch.Tensor
    scales: torch.Tensor | None
    bias: torch.Tensor | None
    wide: torch.Tensor | None = None


class LayerWeights(NamedTuple):
    """One decoder layer. Norm weights are None where the family has no such norm."""

    norm_in: torch.Tensor | None  # before attention (absent in OLMo-2)
    qkv: tuple[Lin, ...]  # one fused projection, or q, k, v where they could not be fused
    q_norm: torch.Tensor | None  # Qwen3 (D,), OLMo-2 (heads * D,)
    k_norm: torch.Tensor | None
    o: Lin
    norm_attn_out: torch.Tensor | None  # on attention's output (Gemma 2, OLMo-2)
    norm_mlp_in: torch.Tensor | None  # before the MLP (absent in OLMo-2)
    gate_up: tuple[Lin, ...]  # one fused projection, or gate and up
    down: Lin
    norm_mlp_out: torch.Tensor | None  # on the MLP's output (Gemma 2, OLMo-2)


def linear(lin: Lin, x: torch.Tensor, wide_rows: int = 0) -> torch.Tensor:
    """(n, K) -> (n, N) through the kernel the weights are stored for (the bf16 copy, where
    kept, for steps of `wide_rows` rows or more)."""
    if lin.scales is None:
        return F.linear(x, lin.weight, lin.bias)
    if lin.wide is not None and 0 < wide_rows <= x.shape[0]:
        return F.linear(x, lin.wide, lin.bias)
    out = lowbit_mm(x, lin.weight, lin.scales)
    return out if lin.bias is None else out + lin.bias


def rms_norm(spec: LeanSpec, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dimension, rounded where each family rounds it."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + spec.eps)
    if spec.norm == "llama":
        return weight * normed.to(x.dtype)
    if spec.norm == "gemma":
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return (weight * normed).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (heads, n, D) by this step's (n, D) rows (rotate-half layout)."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


def make_layer(spec: LeanSpec, wide_rows: int = 0) -> Callable:
    """The layer function for `spec`:

    layer(x, weights, cos, sin, mask, keys, values, slots) -> x
      x: (n, H) residual stream; cos, sin: (n, D) rotary rows of the n positions;
      mask: (n, W) additive float mask over the first W cache slots (this step's included);
      keys, values: (kv_heads, C, D) this layer's cache, written at `slots` (n,) in place.
    wide_rows: steps of this many rows or more use the bf16 copies low-bit weights keep.
    """
    heads, kv, d, groups = spec.heads, spec.kv_heads, spec.head_dim, spec.groups
    mlp_act = ACT2FN[spec.act]

    def norm(x, weight):
        return x if weight is None else rms_norm(spec, x, weight)

    def attention(x, w: LayerWeights, cos, sin, mask, keys, values, slots):
        n = x.shape[0]
        outs = [linear(lin, x, wide_rows) for lin in w.qkv]
        q, k, v = outs if len(outs) == 3 else outs[0].split([heads * d, kv * d, kv * d], -1)
        if spec.qk_norm == "all":
            q, k = norm(q, w.q_norm), norm(k, w.k_norm)
        q, k = q.view(n, heads, d), k.view(n, kv, d)
        if spec.qk_norm == "head":
            q, k = norm(q, w.q_norm), norm(k, w.k_norm)
        q = rotate(q.transpose(0, 1), cos, sin)  # (heads, n, D)
        k = rotate(k.transpose(0, 1), cos, sin)  # (kv, n, D)
        v = v.view(n, kv, d).transpose(0, 1)
        keys.index_copy_(1, slots, k.to(keys.dtype))
        values.index_copy_(1, slots, v.to(values.dtype))
        window = mask.shape[-1]
        # Grouped-query attention without copying the cache: the queries of a group stack
        # up as rows against their one key/value head, (kv, groups * n, D).
        grouped = q.reshape(kv, groups * n, d).to(keys.dtype)
        scores = (grouped @ keys[:, :window].transpose(1, 2)).float() * spec.scaling
        if spec.attn_softcap:
            scores = torch.tanh(scores / spec.attn_softcap) * spec.attn_softcap
        scores = scores + mask.repeat(groups, 1)
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = (probs @ values[:, :window]).view(heads, n, d).transpose(0, 1)
        return linear(w.o, out.reshape(n, heads * d).to(x.dtype), wide_rows)

    def mlp(x, w: LayerWeights):
        outs = [linear(lin, x, wide_rows) for lin in w.gate_up]
        gate, up = outs if len(outs) == 2 else outs[0].chunk(2, dim=-1)
        return linear(w.down, mlp_act(gate) * up, wide_rows)

    def layer(x, w: LayerWeights, cos, sin, mask, keys, values, slots):
        h = attention(norm(x, w.norm_in), w, cos, sin, mask, keys, values, slots)
        x = x + norm(h, w.norm_attn_out)
        h = mlp(norm(x, w.norm_mlp_in), w)
        return x + norm(h, w.norm_mlp_out)

    return layer
