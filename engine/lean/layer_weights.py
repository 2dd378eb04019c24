"""The lean step's weights, taken from the loaded transformers model without copying them:
each layer's tensors as the pure layer function reads them (engine/lean/layer.py).

q/k/v and gate/up are fused into one projection each where that costs no memory: dense
weights are concatenated once and the model's own modules keep views into the fused
tensor; low-bit layers are fused where their packing allows it (`fuse_low_bit`), else
run as separate projections. The transformers model stays usable (the trainer runs it).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.lean.layer import LayerWeights, Projection
from engine.lean.spec import LeanSpec
from engine.weights import pages, quant


def layer_weights(spec: LeanSpec, block: nn.Module) -> LayerWeights:
    """One decoder layer's weights (`block`: a transformers decoder layer of the family)."""
    attn, mlp = block.self_attn, block.mlp
    if spec.fused:  # Phi-3 stores them fused already
        qkv, gate_up = (projection_of(attn.qkv_proj),), (projection_of(mlp.gate_up_proj),)
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
        o=projection_of(attn.o_proj),
        norm_attn_out=(_weight(block.post_attention_layernorm)
                       if spec.sandwich or spec.post_only else None),
        norm_mlp_in=_weight(block.pre_feedforward_layernorm if spec.sandwich
                            else None if spec.post_only else block.post_attention_layernorm),
        gate_up=gate_up,
        down=projection_of(mlp.down_proj),
        norm_mlp_out=(_weight(block.post_feedforward_layernorm)
                      if spec.sandwich or spec.post_only else None),
    )


def projection_of(module: nn.Module) -> Projection:
    """A linear module's tensors as the layer function reads them."""
    if isinstance(module, quant.LowBitLinear):
        if module.padded:  # its kernel's outputs would not split into the layer's
            raise TypeError(f"{module.out_features} outputs do not fill the kernel's groups")
        return Projection(module.weights, module.bias, module.wide)
    if type(module) is not nn.Linear:
        raise TypeError(f"{type(module).__name__} is not a linear layer the lean step runs")
    return Projection(module.weight, None, module.bias)


def fused(parent: nn.Module, names: tuple[str, ...]) -> tuple[Projection, ...]:
    """The projections `names` of `parent` as one fused Projection where that costs no memory, else
    one Projection each. The modules are rebound to views into the fused weights."""
    modules = [getattr(parent, n) for n in names]
    if all(type(m) is nn.Linear for m in modules):
        return (_fuse_dense(modules),)
    if all(isinstance(m, quant.LowBitLinear) for m in modules):
        one = fuse_low_bit(modules)
        if one is not None:
            return (Projection(one.weights, one.bias),)
    return tuple(projection_of(m) for m in modules)


def _fuse_dense(modules: list[nn.Linear]) -> Projection:
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
    return Projection(weight, None, bias)


def _weight(norm: nn.Module | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def fuse_low_bit(layers: list[quant.LowBitLinear]) -> quant.LowBitLinear | None:
    """One layer computing `layers`' outputs side by side (q, k, v -> qkv), or None where
    their kinds or inputs differ, or the kernel's packing does not concatenate at their
    boundaries. The fused layer owns the weights: each of `layers` is rebound to views
    into it, so nothing is stored twice."""
    first = layers[0]
    # kinds, inputs, biases and kernels alike, and no bf16 copies kept (they stay per layer)
    if any(m.kind != first.kind or m.in_features != first.in_features or m.wide is not None
           or (m.bias is None) != (first.bias is None) or m.kernel != first.kernel
           for m in layers):
        return None
    blocks = first.blocks  # `scales` names their block type: it must be theirs alike
    if blocks and any(m.padded or not torch.equal(m.scales, first.scales) for m in layers):
        return None
    # PyTorch's int4 scales: (K/group, N, 2); the others' rows come first
    axis = 1 if first.kind == "int4" and not blocks else 0
    if axis and not _packing_concatenates([m.out_features for m in layers],
                                          first.in_features, first.packed.device):
        return None
    fused = quant.LowBitLinear.__new__(quant.LowBitLinear)
    nn.Module.__init__(fused)
    fused.kind, fused.in_features = first.kind, first.in_features
    fused.packed_for, fused.kernel = first.packed_for, first.kernel
    fused.out_features = sum(m.out_features for m in layers)
    fused.bias = None if first.bias is None else nn.Parameter(
        torch.cat([m.bias for m in layers]), False)
    parts = [m.packed for m in layers]
    # blocks stream from memory every step: into memory in huge pages (engine/weights/pages.py;
    # host memory, where Quickdraft's block kernels run)
    host = blocks and parts[0].device.type == "cpu"
    out = pages.weight_buffer((sum(p.shape[0] for p in parts), *parts[0].shape[1:]),
                              parts[0].dtype) if host else None
    fused.register_buffer("packed", torch.cat(parts, out=out))
    fused.register_buffer("scales", first.scales if blocks else
                          torch.cat([m.scales for m in layers], dim=axis))
    fused.wide, fused.wide_rows = None, 0
    start = 0
    for m in layers:
        rows = slice(start, start + m.out_features)
        m.packed = fused.packed[rows]
        if not blocks:
            m.scales = fused.scales[:, rows] if axis else fused.scales[rows]
        if m.bias is not None:
            m.bias = nn.Parameter(fused.bias[rows], False)
        start = rows.stop
    return fused


def _packing_concatenates(rows: list[int], k: int, device: torch.device) -> bool:
    """Whether the int4 packing of stacked layers equals their packings stacked (the CPU
    kernel packs rows in blocks): probed on random codes of these shapes."""
    generator = torch.Generator().manual_seed(0)
    parts = [torch.randint(0, 16, (n, k), dtype=torch.int32, generator=generator) for n in rows]
    try:
        whole = quant.pack_int4(torch.cat(parts), device)
        return torch.equal(whole, torch.cat([quant.pack_int4(p, device) for p in parts]))
    except RuntimeError:  # a part the kernel cannot pack on its own
        return False
