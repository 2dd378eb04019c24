"""The lean step's weights, taken from the loaded transformers model without copying them:
each layer's tensors as the pure layer function reads them (engine/lean/layer.py).

q/k/v and gate/up are fused into one projection each where that costs no memory: dense
weights are concatenated once and the model's own modules keep views into the fused
tensor; low-bit layers are fused where their packing allows it (engine.quant.fuse), else
run as separate projections. The transformers model stays usable (the trainer runs it).
"""

from __future__ import annotations

import torch
from torch import nn

from engine import quant
from engine.lean.layer import LayerWeights, Lin
from engine.lean.spec import LeanSpec


def layer_weights(spec: LeanSpec, block: nn.Module) -> LayerWeights:
    """One decoder layer's weights (`block`: a transformers decoder layer of the family)."""
    attn, mlp = block.self_attn, block.mlp
    if spec.fused:  # Phi-3 stores them fused already
        qkv, gate_up = (lin_of(attn.qkv_proj),), (lin_of(mlp.gate_up_proj),)
    else:
        qkv = fused(attn, ("q_proj", "k_proj", "v_proj"))
        gate_up = fused(mlp, ("gate_proj", "up_proj"))
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return LayerWeights(
        norm_in=None if spec.post_only else _weight(block.input_layernorm),
        qkv=qkv,
        q_norm=_weight(q_norm),
        k_norm=_weight(k_norm),
        o=lin_of(attn.o_proj),
        norm_attn_out=(_weight(block.post_attention_layernorm)
                       if spec.sandwich or spec.post_only else None),
        norm_mlp_in=_weight(block.pre_feedforward_layernorm if spec.sandwich
                            else None if spec.post_only else block.post_attention_layernorm),
        gate_up=gate_up,
        down=lin_of(mlp.down_proj),
        norm_mlp_out=(_weight(block.post_feedforward_layernorm)
                      if spec.sandwich or spec.post_only else None),
    )


def lin_of(module: nn.Module) -> Lin:
    """A linear module's tensors as the layer function reads them."""
    if isinstance(module, quant.LowBitLinear):
        return Lin(module.packed, module.scales, module.bias, module.wide)
    if type(module) is not nn.Linear:
        raise TypeError(f"{type(module).__name__} is not a linear layer the lean step runs")
    return Lin(module.weight, None, module.bias)


def fused(parent: nn.Module, names: tuple[str, ...]) -> tuple[Lin, ...]:
    """The projections `names` of `parent` as one fused Lin where that costs no memory, else
    one Lin each. The modules are rebound to views into the fused weights."""
    modules = [getattr(parent, n) for n in names]
    if all(type(m) is nn.Linear for m in modules):
        return (_fuse_dense(modules),)
    if all(isinstance(m, quant.LowBitLinear) for m in modules):
        one = quant.fuse(modules)
        if one is not None:
            return (Lin(one.packed, one.scales, one.bias),)
    return tuple(lin_of(m) for m in modules)


def _fuse_dense(modules: list[nn.Linear]) -> Lin:
    """Concatenate the weights (and biases) along the outputs, once; each module then holds
    a view of its rows, so the weights exist once."""
    weight = torch.cat([m.weight.detach() for m in modules])
    biases = [m.bias for m in modules]
    bias = None
    if all(b is not None for b in biases):
        bias = torch.cat([b.detach() for b in biases])
    elif any(b is not None for b in biases):  # some with a bias: fill in zeros
        bias = torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.out_features)
                          for m, b in zip(modules, biases, strict=True)])
    start = 0
    for m in modules:
        end = start + m.out_features
        m.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return Lin(weight, None, bias)


def _weight(norm: nn.Module | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight
