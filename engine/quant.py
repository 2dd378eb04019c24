"""Weight-only low-bit linear layers.

`int4`: 4-bit weights in groups of 32 input features (asymmetric: a scale and a low per
group, the form of llama.cpp's Q4_1), multiplied by tinygemm's `aten._weight_int4pack_mm`
on CUDA. `int8w`: 8-bit weights with a scale per output row, multiplied by
`torch._weight_int8pack_mm` on CUDA. On a CPU both run on Quickdraft's own kernels
(engine/kernels: activations quantized to int8 per block of 32, as llama.cpp does, and
integer dot products; int8 scales in float32, int4 ones in float16) where those could be
built, else on `aten._weight_int4pack_mm_for_cpu` and `torch._weight_int8pack_mm` (bf16
scales). Activations stay bf16 between layers.

On a CPU a step's cost grows with every row (token) of the input: Quickdraft's kernels read
a weight row once for up to 8 rows, so a step of 4 tokens costs ~1.7 plain steps on AVX2
(measured on the bundled model). Where a CPU multiplies bf16 at about the same cost for 1
or 32 rows, each layer can also keep its dequantized weights in bf16 (`wide`, opt-in) and
multiply rows from `wide_rows` on with those: the same weights up to bf16 rounding.
`wide_rows` comes from measured costs (engine/quant_wide.py), so where the low-bit kernel
stays cheap no copy is kept. The copies cost memory (bf16 weights beside the low-bit ones);
tied embeddings look up the LM head's dequantized table, so the head's copy is free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine import int4_layout, kernels
from engine.errors import ModelLoadError
from engine.quant_wide import measured_wide_rows

LOW_BIT = ("int4", "int8w")  # the --quant choices this module implements
GROUP_SIZE = int4_layout.BLOCK  # int4: inputs sharing one scale and zero point (as Q4_1)
CUDA_INNER_K_TILES = (8, 4, 2)  # tinygemm's packings, fastest first: K % (16 * tiles) == 0
# The LM head's kind per choice: 8-bit under int4, as llama.cpp's Q4 files keep their
# token table in Q8_0/Q6_K (the head is where 4 bits cost the most perplexity).
HEAD_KIND = {"int4": "int8w", "int8w": "int8w"}


@dataclass
class Codes:
    """Low-bit weights in a device-neutral layout (what the kernels are packed from).

    int4: `values` (N, K) 0..15 with `scale` and `low` (N, K/group):
    w = value * scale + low (llama.cpp's Q4_0 and Q4_1 blocks of 32 are exactly this form);
    the kernels take bf16 scales and zeros (`kernel_scales`), a converted folder keeps fp32.
    int8w: `values` (N, K) int8 and a bf16 `scale` per row (N,): w = value * scale."""

    kind: str  # int4 | int8w
    values: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor | None = None  # int4 only

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @classmethod
    def of(cls, weight: torch.Tensor, kind: str) -> Codes:
        """Quantize (N, K) float weights (asymmetric int4 per group, symmetric int8 per row)."""
        w = weight.detach().to("cpu", torch.float32).contiguous()
        n, k = w.shape
        if kind == "int8w":
            scale = (w.abs().amax(1) / 127).clamp(min=1e-8).to(torch.bfloat16)
            values = (w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
            return cls(kind, values, scale)
        groups = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8)
        values = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        return cls(kind, values.to(torch.uint8).reshape(n, k), scale, low)

    def kernel_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero) in the kernels' bf16 and tinygemm's w = (value - 8) * scale + zero."""
        if self.kind == "int8w":
            return self.scale.to(torch.bfloat16), None
        zero = self.low.float() + 8 * self.scale.float()
        return self.scale.to(torch.bfloat16), zero.to(torch.bfloat16)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (N, K) weights these codes stand for."""
        if self.kind == "int8w":
            return (self.values.float() * self.scale.float()[:, None]).to(dtype)
        n, k = self.shape
        w = (self.values.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float()
             * self.scale.float()[..., None] + self.low.float()[..., None])
        return w.reshape(n, k).to(dtype)

    def kernel_dense(self) -> torch.Tensor:
        """The (N, K) bf16 weights the kernel multiplies by (its bf16 scales applied)."""
        scale, zero = self.kernel_scales()
        if self.kind == "int8w":
            return (self.values.float() * scale.float()[:, None]).to(torch.bfloat16)
        n, k = self.shape
        w = ((self.values.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float() - 8)
             * scale.float()[..., None] + zero.float()[..., None])
        return w.reshape(n, k).to(torch.bfloat16)


def _inner_tiles(k: int) -> int:
    """tinygemm's inner K tiles for K input features (0: no packing fits)."""
    return next((t for t in CUDA_INNER_K_TILES if k % (16 * t) == 0), 0)


def _pack_int4(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":  # tinygemm wants two codes per byte, high nibble first
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_tiles(codes.shape[1]))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(device), 1)


class LowBitLinear(nn.Module):
    """An nn.Linear with weight-only int4 or int8 weights (bf16 activations in and out).

    Built from canonical codes (`Codes`, also what a converted GGUF folder stores), packed
    here for the device's kernel."""

    def __init__(self, codes: Codes, bias: torch.Tensor | None, device: torch.device,
                 wide: bool = False):
        super().__init__()
        self.kind = codes.kind
        self.out_features, self.in_features = codes.shape
        self.bias = (None if bias is None else
                     nn.Parameter(bias.detach().to(device, torch.bfloat16), False))
        scale, zero = codes.kernel_scales()
        # float32 (int8) and float16 (int4) scales select Quickdraft's kernels (`lowbit_mm`)
        ours = (device.type == "cpu" and self.in_features % GROUP_SIZE == 0
                and kernels.available())
        # The device type whose kernel the layout is for ("": any; `_apply` keeps it there)
        self.packed_for = device.type if codes.kind == "int4" or ours else ""
        if codes.kind == "int4" and ours and self.out_features % int4_layout.ROWS == 0:
            packed, scales = int4_layout.pack(codes.values, codes.scale, codes.low)
            self.register_buffer("packed", packed)
            self.register_buffer("scales", scales)
        elif codes.kind == "int4":
            self.register_buffer("packed", _pack_int4(codes.values.to(torch.int32), device))
            # (K/group, N, 2): scale and zero per group and output, the kernels' layout
            self.register_buffer("scales", torch.stack([scale, zero], -1).transpose(0, 1)
                                 .contiguous().to(device))
        else:
            self.register_buffer("packed", codes.values.to(device))
            self.register_buffer("scales", (scale.float() if ours else scale).to(device))
        # (N, K) bf16 dequantized weights for wide steps, kept only when asked (they cost
        # more memory than the codes); None: every step uses the kernel
        self.wide: torch.Tensor | None = codes.kernel_dense().to(device) if wide else None
        self.wide_rows = 0  # rows from which a step uses `wide` (0: never); see `crossover`

    def _apply(self, fn, *args, **kwargs):
        # Kernels are chosen by the scales' dtype, and int4 layouts differ by device: a layer
        # packed for one device's kernel would run the wrong one on another. The target is
        # probed with an empty tensor first, so a refused move leaves the layer whole.
        if self.packed_for:
            probe = fn(torch.empty(0, dtype=self.packed.dtype, device=self.packed.device))
            if probe.device.type != self.packed_for:
                raise ModelLoadError(
                    f"this {self.kind} layer is packed for the {self.packed_for} kernels and "
                    f"cannot run on {probe.device.type}: load the model again with --device "
                    f"{probe.device.type} to quantize it there")
        return super()._apply(fn, *args, **kwargs)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str, device: torch.device,
                    wide: bool = False) -> LowBitLinear:
        return cls(Codes.of(linear.weight, kind), linear.bias, device, wide)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized (N, K) bf16 weights (drafters read the LM head's rows)."""
        return self.wide if self.wide is not None else self.dequantized()

    def dequantized(self) -> torch.Tensor:
        if self.kind == "int8w":
            return (self.packed.float() * self.scales.float()[:, None]).to(torch.bfloat16)
        if self.scales.dtype == torch.float16:  # Quickdraft's int4 layout
            return int4_layout.dense(self.packed, self.scales).to(torch.bfloat16)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        return self.low_bit(eye).t().contiguous()  # (K, N) rows of W^T, exactly the kernel's

    def low_bit(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) bf16 -> (M, N) through the low-bit kernel."""
        # A layer fused with others (`fuse`) holds a strided view of the fused scales; the
        # kernels read them as contiguous.
        return lowbit_mm(x, self.packed, self.scales.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every call is on the per-token path, 200+ times a step: no op that would do nothing.
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.bfloat16:
            rows = rows.to(torch.bfloat16)
        if self.wide is not None and 0 < self.wide_rows <= rows.shape[0]:
            out = rows @ self.wide.t()
        else:
            out = self.low_bit(rows if rows.is_contiguous() else rows.contiguous())
        if self.bias is not None:
            out = out + self.bias
        out = out.view(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, kind={self.kind}, "
                f"wide_rows={self.wide_rows}")


def lowbit_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(M, K) -> (M, N) through the kernel `packed` and `scales` were stored for:
    Quickdraft's where int8 codes have float32 scales and int4 ones float16 scales,
    PyTorch's where they have bf16 ones."""
    if packed.dtype == torch.int8:
        if scales.dtype == torch.float32:
            return torch.ops.quickdraft.q8_linear(x, packed, scales)
        if x.device.type == "cpu" and packed.shape[1] % 16:
            # PyTorch's CPU kernel crashes (segfault) on such widths for 2 rows or more on
            # some CPUs (a Xeon with AVX-512 and AMX, torch 2.13): the same product,
            # dequantized.
            return ((x.float() @ packed.float().T) * scales.float()).to(x.dtype)
        return torch._weight_int8pack_mm(x, packed, scales)
    if scales.dtype == torch.float16:
        return torch.ops.quickdraft.q4_linear(x, packed, scales)
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP_SIZE, scales)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP_SIZE, scales)


def fuse(layers: list[LowBitLinear]) -> LowBitLinear | None:
    """One layer computing `layers`' outputs side by side (q, k, v -> qkv), or None where
    their kinds or inputs differ, or the kernel's packing does not concatenate at their
    boundaries. The fused layer owns the weights: each of `layers` is rebound to views
    into it, so nothing is stored twice."""
    first = layers[0]
    if any(m.kind != first.kind or m.in_features != first.in_features for m in layers):
        return None
    if any(m.wide is not None for m in layers):  # bf16 copies kept: they stay per layer
        return None
    if any((m.bias is None) != (first.bias is None) for m in layers):
        return None
    if any(m.scales.dtype != first.scales.dtype for m in layers):  # kernels differ
        return None
    # PyTorch's int4 scales: (K/group, N, 2); the others' rows come first
    axis = 1 if first.kind == "int4" and first.scales.dtype == torch.bfloat16 else 0
    if axis and not _packing_concatenates([m.out_features for m in layers],
                                          first.in_features, first.packed.device):
        return None
    fused = LowBitLinear.__new__(LowBitLinear)
    nn.Module.__init__(fused)
    fused.kind, fused.in_features = first.kind, first.in_features
    fused.packed_for = first.packed_for
    fused.out_features = sum(m.out_features for m in layers)
    fused.bias = None if first.bias is None else nn.Parameter(
        torch.cat([m.bias for m in layers]), False)
    fused.register_buffer("packed", torch.cat([m.packed for m in layers]))
    fused.register_buffer("scales", torch.cat([m.scales for m in layers], dim=axis))
    fused.wide, fused.wide_rows = None, 0
    start = 0
    for m in layers:
        rows = slice(start, start + m.out_features)
        m.packed = fused.packed[rows]
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
        whole = _pack_int4(torch.cat(parts), device)
        return torch.equal(whole, torch.cat([_pack_int4(p, device) for p in parts]))
    except RuntimeError:  # a part the kernel cannot pack on its own
        return False


def fits(linear: nn.Linear, kind: str, device: torch.device) -> bool:
    """Whether the kernels take this layer's shape (others stay bf16)."""
    k, n = linear.in_features, linear.out_features
    if kind == "int8w":
        return True
    if device.type == "cuda":
        return _inner_tiles(k) > 0 and n % 8 == 0 and k % GROUP_SIZE == 0
    rows = int4_layout.ROWS if kernels.available() else 16  # PyTorch's CPU packing: N % 16
    return k % GROUP_SIZE == 0 and n % rows == 0


def _as_linear(module: nn.Module) -> nn.Linear | None:
    """nn.Linear, or GPT-2's Conv1D (weight stored (K, N)) seen as one; else None."""
    if isinstance(module, nn.Linear):
        return module
    if type(module).__name__ == "Conv1D" and module.weight.dim() == 2:
        k, n = module.weight.shape
        linear = nn.Linear(k, n, bias=module.bias is not None, device="meta")
        linear.weight = nn.Parameter(module.weight.detach().t(), False)
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.detach(), False)
        return linear
    return None


def quantize_model(model: nn.Module, kind: str, wide_rows: int | None = 0,
                   device: torch.device | None = None) -> nn.Module:
    """Replace every linear layer of a loaded causal LM (the LM head included) by a
    LowBitLinear in place; the rest goes to bf16. `wide_rows`: 0 (the default) keeps the
    codes alone and runs every step on the kernels; n keeps bf16 copies of the weights and
    runs steps of n rows or more on them; None measures that n here (`crossover`).
    `device`: where the model runs (default: where it is). A model still on the CPU is
    quantized layer by layer onto it, so no bf16 copy of the whole model ever sits on a GPU
    (the models that need 4 bits are the ones whose bf16 weights do not fit there)."""
    if kind not in LOW_BIT:
        raise ModelLoadError(f"unknown low-bit choice {kind!r}: choose one of {LOW_BIT}")
    here = next(model.parameters()).device
    device = here if device is None else device
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    model.to(torch.bfloat16)
    targets = [(name, linear, HEAD_KIND[kind] if module is head else kind)
               for name, module in model.named_modules()
               if (linear := _as_linear(module)) is not None]
    targets = [t for t in targets if fits(t[1], t[2], device)]
    if not targets:
        raise ModelLoadError(f"no linear layer of this model fits the {kind} kernels")
    for name, linear, layer_kind in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child,
                LowBitLinear.from_linear(linear, layer_kind, device, wide_rows != 0))
    if tied:
        tie_embedding(model)
    if device != here:
        model.to(device)  # what stays unquantized (norms, an untied table) follows the codes
    else:
        own_memory(model)
    rows = measured_wide_rows(low_bit_layers(model)) if wide_rows is None else wide_rows
    set_wide_rows(model, rows)
    return model


def own_memory(model: nn.Module) -> None:
    """Copy the tensors quantizing left in place (norms, an untied table) into memory of
    their own: loaded from a memory-mapped safetensors file, each still maps the file, and
    the kernel then keeps every page of the full-precision file resident beside the codes."""
    for module in model.modules():
        if isinstance(module, LowBitLinear):
            continue
        for tensors in (module._parameters, module._buffers):
            for tensor in tensors.values():
                if tensor is not None:
                    tensor.data = tensor.data.clone()


def tie_embedding(model: nn.Module) -> None:
    """A tied table whose head went low-bit: the embedding looks its rows up in the head's
    codes (one table, as in GGUF files, and no bf16 copy of it)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if not isinstance(head, LowBitLinear):
        return
    if head.kind == "int8w" and type(embedding) is nn.Embedding:
        model.set_input_embeddings(CodedEmbedding(head))
    else:  # a family's own embedding module (e.g. a scaled one): a dense table, once
        embedding.weight = nn.Parameter(head.dequantized(), requires_grad=False)


class CodedEmbedding(nn.Module):
    """Token embeddings read from an 8-bit LM head's codes: row t is codes[t] * scale[t]
    in bf16, the same values the head multiplies by, without a table of their own."""

    def __init__(self, head: LowBitLinear):
        super().__init__()
        self.head = [head]  # a list: the head is the model's module, not a child of this one
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        rows = head.packed[ids].float() * head.scales[ids].float()[..., None]
        return rows.to(torch.bfloat16)

    @property
    def weight(self) -> torch.Tensor:
        """The whole (V, H) table, made on demand (what code reading a table gets)."""
        return self.forward(torch.arange(self.num_embeddings, device=self.head[0].packed.device))


def low_bit_layers(model: nn.Module) -> list[LowBitLinear]:
    return [m for m in model.modules() if isinstance(m, LowBitLinear)]


def set_wide_rows(model: nn.Module, rows: int) -> None:
    """Use the bf16 copies from `rows` rows on (0: never, and drop them)."""
    for layer in low_bit_layers(model):
        layer.wide_rows = rows
        if rows == 0:
            layer.wide = None
