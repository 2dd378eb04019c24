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
from engine.weights.lowbit import LowBitWeights


class Projection(NamedTuple):
    """A linear layer's tensors. weight: (N, K) dense, or low-bit weights with their kernel
    (engine.weights.lowbit.LowBitWeights); wide: the low-bit weights' bf16 copy where one is
    kept for steps of many rows (engine/weights/quant.py)."""

    weight: torch.Tensor | LowBitWeights
    bias: torch.Tensor | None
    wide: torch.Tensor | None = None


class LayerWeights(NamedTuple):
    """One decoder layer. Norm weights are None where the family has no such norm."""

    norm_in: torch.Tensor | None  # before attention (absent in OLMo-2)
    qkv: tuple[Projection, ...]  # one fused projection, or q, k, v where they could not be fused
    q_norm: torch.Tensor | None  # Qwen3 (D,), OLMo-2 (heads * D,)
    k_norm: torch.Tensor | None
    o: Projection
    norm_attn_out: torch.Tensor | None  # on attention's output (Gemma 2, OLMo-2)
    norm_mlp_in: torch.Tensor | None  # before the MLP (absent in OLMo-2)
    gate_up: tuple[Projection, ...]  # one fused projection, or gate and up
    down: Projection
    norm_mlp_out: torch.Tensor | None  # on the MLP's output (Gemma 2, OLMo-2)


def linear(lin: Projection, x: torch.Tensor, wide_rows: int = 0) -> torch.Tensor:
    """(n, K) -> (n, N) through the kernel the weights are stored for (the bf16 copy, where
    kept, for steps of `wide_rows` rows or more)."""
    if not isinstance(lin.weight, LowBitWeights):
        return F.linear(x, lin.weight, lin.bias)
    if lin.wide is not None and 0 < wide_rows <= x.shape[0]:
        return F.linear(x, lin.wide, lin.bias)
    out = lin.weight.mm(x)
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


class StepInputs(NamedTuple):
    """A layer call's inputs besides its weights, in the one order the layer function, its
    compiled packages (which take them by position) and every caller use."""

    x: torch.Tensor  # (n, H) residual stream
    cos: torch.Tensor  # (n, D) rotary rows of the n positions
    sin: torch.Tensor
    mask: torch.Tensor  # (n, W) additive float mask over the first W cache slots
    keys: torch.Tensor  # (kv_heads, C, D) this layer's cache, written at `slots` in place
    values: torch.Tensor
    slots: torch.Tensor  # (n,) the cache slots this step writes


# What a compiled package leaves symbolic in each input: the mask's window and the cache's
# capacity (a step's size is fixed per package).
SYMBOLIC = StepInputs(None, None, None, {1: "window"}, {1: "capacity"}, {1: "capacity"}, None)


class BatchLengths(NamedTuple):
    """A batched step's attention span per row, for Quickdraft's decode-attention kernel
    (in place of a mask): row r attends to its slots 0..lengths[r]-1 (the last one its
    own), only the last `window` of them where the layer has a sliding window."""

    lengths: torch.Tensor  # (n,) long
    window: int | None


def make_layer(spec: LeanSpec, wide_rows: int = 0, batched: bool = False) -> Callable:
    """The layer function for `spec`:

    layer(weights, *StepInputs) -> x, the layer's output (n, H) (StepInputs says what each
      input is; the mask covers this step's slots too).
    wide_rows: steps of this many rows or more use the bf16 copies low-bit weights keep.
    batched: the n rows are n independent sequences, one token each (engine/lean/batch.py):
      keys, values are then (n, kv_heads, C, D), one cache row per sequence, and row r
      writes its slot slots[r] and attends to its own row under mask[r] (or over the span
      a BatchLengths gives, through Quickdraft's kernel).
    """
    heads, kv, d, groups = spec.heads, spec.kv_heads, spec.head_dim, spec.groups
    mlp_act = ACT2FN[spec.act]

    def norm(x, weight):
        return x if weight is None else rms_norm(spec, x, weight)

    def project(x, w: LayerWeights, cos, sin):
        """(n, H) -> rotated q (heads, n, D), k (kv, n, D) and v (kv, n, D)."""
        n = x.shape[0]
        outs = [linear(lin, x, wide_rows) for lin in w.qkv]
        q, k, v = outs if len(outs) == 3 else outs[0].split([heads * d, kv * d, kv * d], -1)
        if spec.qk_norm == "all":
            q, k = norm(q, w.q_norm), norm(k, w.k_norm)
        q, k = q.view(n, heads, d), k.view(n, kv, d)
        if spec.qk_norm == "head":
            q, k = norm(q, w.q_norm), norm(k, w.k_norm)
        q = rotate(q.transpose(0, 1), cos, sin)
        k = rotate(k.transpose(0, 1), cos, sin)
        return q, k, v.view(n, kv, d).transpose(0, 1)

    def attend(scores, mask):
        """Soft-capped, masked softmax over the last dimension, in float32."""
        scores = scores.float() * spec.scaling
        if spec.attn_softcap:
            scores = torch.tanh(scores / spec.attn_softcap) * spec.attn_softcap
        return torch.softmax(scores + mask, dim=-1)

    def attention(x, w: LayerWeights, cos, sin, mask, keys, values, slots):
        n = x.shape[0]
        q, k, v = project(x, w, cos, sin)
        keys.index_copy_(1, slots, k.to(keys.dtype))
        values.index_copy_(1, slots, v.to(values.dtype))
        window = mask.shape[-1]
        # Grouped-query attention without copying the cache: the queries of a group stack
        # up as rows against their one key/value head, (kv, groups * n, D).
        grouped = q.reshape(kv, groups * n, d).to(keys.dtype)
        probs = attend(grouped @ keys[:, :window].transpose(1, 2), mask.repeat(groups, 1))
        out = (probs.to(values.dtype) @ values[:, :window]).view(heads, n, d).transpose(0, 1)
        return linear(w.o, out.reshape(n, heads * d).to(x.dtype), wide_rows)

    def batch_attention(x, w: LayerWeights, cos, sin, mask, keys, values, slots):
        n = x.shape[0]
        q, k, v = project(x, w, cos, sin)
        rows = torch.arange(n, device=x.device)
        keys[rows, :, slots] = k.transpose(0, 1).to(keys.dtype)  # (n, kv, D) at each row's slot
        values[rows, :, slots] = v.transpose(0, 1).to(values.dtype)
        if isinstance(mask, BatchLengths):  # Quickdraft's kernel reads each row's own length
            out = torch.ops.quickdraft.decode_attention(
                q.transpose(0, 1).contiguous().to(keys.dtype), keys, values, mask.lengths,
                spec.scaling, spec.attn_softcap or 0.0, mask.window or 0)
            return linear(w.o, out.reshape(n, heads * d).to(x.dtype), wide_rows)
        window = mask.shape[-1]
        grouped = q.transpose(0, 1).reshape(n, kv, groups, d).to(keys.dtype)  # (n, kv, g, D)
        probs = attend(grouped @ keys[:, :, :window].transpose(2, 3), mask[:, None, None])
        out = probs.to(values.dtype) @ values[:, :, :window]  # (n, kv, g, D)
        return linear(w.o, out.reshape(n, heads * d).to(x.dtype), wide_rows)

    attention_of = batch_attention if batched else attention

    def mlp(x, w: LayerWeights):
        outs = [linear(lin, x, wide_rows) for lin in w.gate_up]
        gate, up = outs if len(outs) == 2 else outs[0].chunk(2, dim=-1)
        return linear(w.down, mlp_act(gate) * up, wide_rows)

    def layer(w: LayerWeights, x, cos, sin, mask, keys, values, slots):
        h = attention_of(norm(x, w.norm_in), w, cos, sin, mask, keys, values, slots)
        x = x + norm(h, w.norm_attn_out)
        h = mlp(norm(x, w.norm_mlp_in), w)
        return x + norm(h, w.norm_mlp_out)

    return layer
