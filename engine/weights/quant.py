"""Weight-only low-bit linear layers.

`int4`: 4-bit weights in groups of 32 input features (asymmetric: a scale and a low per
group, llama.cpp's Q4_1), multiplied by tinygemm's `aten._weight_int4pack_mm` on CUDA.
`int8w`: 8-bit weights with a scale per output row, by `torch._weight_int8pack_mm` on CUDA.
On a CPU both run on Quickdraft's own block kernels (engine/weights/kernels: activations quantized
to int8 per block of 32, as llama.cpp does, integer dot products, 8 or 16 outputs at once)
where those could be built, else on PyTorch's CPU kernels (bf16 scales). Activations stay
bf16 between layers.

A step's cost grows with every row (token) of the input. Where a CPU multiplies bf16 at
about the same cost for 1 or 32 rows, each layer can also keep its dequantized weights in
bf16 (`wide`, opt-in) and multiply rows from `wide_rows` on with those: the same weights up
to bf16 rounding, at the cost of their memory (engine/weights/quant_wide.py measures `wide_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.weights import kernels
from engine.weights.lowbit import GROUP_SIZE, KERNELS, LowBitWeights
from engine.weights.quant_wide import measured_wide_rows

LOW_BIT = ("int4", "int8w")  # the --quant choices this module implements
# The block formats (engine/weights/kernels/formats.h) Quickdraft's own kernels store each kind in:
# int4 is llama.cpp's Q4_1 (float16 scale and low), int8w its own (a float32 scale per row).
BLOCK_TYPE = {"int4": 3, "int8w": 256}
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

    def rows(self) -> torch.Tensor:
        """The codes as Quickdraft's kernels' blocks (engine/weights/kernels/formats.h), (N, bytes
        per row) uint8: int4 as Q4_1 blocks (float16 scale and low, then 16 bytes holding
        value i in the low nibble and value i + 16 in the high one), int8w as its int8 codes
        then its float32 row scale."""
        n, k = self.shape
        if self.kind == "int8w":
            scale = self.scale.float().contiguous().view(torch.uint8).reshape(n, 4)
            return torch.cat([self.values.contiguous().view(torch.uint8), scale], 1)
        groups = self.values.reshape(n, k // GROUP_SIZE, GROUP_SIZE).to(torch.uint8)
        nibbles = groups[..., :GROUP_SIZE // 2] | groups[..., GROUP_SIZE // 2:] << 4
        halves = torch.stack([self.scale.half(), self.low.half()], -1).view(torch.uint8)
        return torch.cat([halves, nibbles], -1).reshape(n, -1)

    def kernel_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero) in the kernels' bf16 and tinygemm's w = (value - 8) * scale + zero."""
        if self.kind == "int8w":
            return self.scale.to(torch.bfloat16), None
        zero = self.low.float() + 8 * self.scale.float()
        return self.scale.to(torch.bfloat16), zero.to(torch.bfloat16)

    def dense(self, dtype: torch.dtype = torch.float32, kernel: bool = False) -> torch.Tensor:
        """The (N, K) weights these codes stand for; `kernel`: those the kernel multiplies by
        (its bf16 scales applied, int4 in tinygemm's w = (value - 8) * scale + zero)."""
        scale, low = self.kernel_scales() if kernel else (self.scale, self.low)
        n, k = self.shape
        scale = scale.float().reshape(n, -1, 1)  # per row (int8w) or per group (int4)
        w = self.values.float().reshape(n, scale.shape[1], -1)
        if low is None:
            w = w * scale
        else:
            w = (w - 8 if kernel else w) * scale + low.float().reshape(n, -1, 1)
        return w.reshape(n, k).to(dtype)


def _inner_tiles(k: int) -> int:
    """tinygemm's inner K tiles for K input features (0: no packing fits)."""
    return next((t for t in CUDA_INNER_K_TILES if k % (16 * t) == 0), 0)


def pack_int4(codes: torch.Tensor, device: torch.device) -> torch.Tensor:
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
        ours = own_kernels(device, self.in_features, self.out_features, codes.kind)
        self.kernel = "blocks" if ours else "int4" if codes.kind == "int4" else "int8"
        # The device type whose kernel the layout is for ("": any; `_apply` keeps it there)
        self.packed_for = "" if self.kernel == "int8" else device.type
        if ours:
            # Quickdraft's kernels: the codes as blocks, repacked for them; `scales` holds
            # their block type and group width (int64)
            packed, scales = repack(codes.rows(), BLOCK_TYPE[codes.kind])
        elif self.kernel == "int4":
            packed = pack_int4(codes.values.to(torch.int32), device)
            # (K/group, N, 2): scale and zero per group and output, the kernels' layout
            scales = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(device)
        else:
            packed, scales = codes.values.to(device), scale.to(device)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        # (N, K) bf16 dequantized weights for wide steps, kept only when asked (they cost
        # more memory than the codes); None: every step uses the kernel
        self.wide: torch.Tensor | None = (codes.dense(torch.bfloat16, kernel=True).to(device)
                                          if wide else None)
        self.wide_rows = 0  # rows from which a step uses `wide` (0: never); see `crossover`

    def _apply(self, fn, *args, **kwargs):
        # A layer's kernel was chosen for its device, and int4 layouts differ by device: a
        # layer packed for one device's kernel cannot run on another. The target is
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

    @property
    def blocks(self) -> bool:
        """Whether the weights are blocks for Quickdraft's kernels (`scales`: their type)."""
        return self.kernel == "blocks"

    @property
    def weights(self) -> LowBitWeights:
        return LowBitWeights(self.packed, self.scales, self.kernel)

    @property
    def padded(self) -> bool:
        """Whether zero rows fill the blocks' last group (such a layer is not fused)."""
        return self.packed.shape[0] != self.out_features

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """(len(ids), K) float32 weights of outputs `ids` (a token table's or a draft
        vocabulary's rows), without a dense copy of the others where the layout allows it."""
        if self.blocks:
            return torch.ops.quickdraft.block_rows(self.packed, self.scales, ids)
        if self.kernel == "int8":
            return self.packed[ids].float() * self.scales[ids].float()[:, None]
        return self.dequantized()[ids].float()

    def dequantized(self) -> torch.Tensor:
        if self.kernel == "int4":  # tinygemm's packing: (K, N) rows of W^T, exactly the kernel's
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
            return self.low_bit(eye).t().contiguous()
        rows = torch.arange(self.out_features, device=self.packed.device)
        return self.rows(rows).to(torch.bfloat16)

    def low_bit(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) bf16 -> (M, N) through the low-bit kernel."""
        # A layer fused with others (`fuse`) holds a strided view of the fused scales; the
        # kernels read them as contiguous.
        out = KERNELS[self.kernel](x, self.packed, self.scales.contiguous())
        return out[:, :self.out_features] if self.padded else out

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


def own_kernels(device: torch.device, k: int, n: int, kind: str) -> bool:
    """Whether a (n, k) layer of `kind` runs on Quickdraft's kernels here (int4 layers whose
    outputs do not fill groups of 8 take PyTorch's kernel)."""
    if device.type != "cpu" or k % GROUP_SIZE or not kernels.available():
        return False
    return kind == "int8w" or n % NARROW == 0


NARROW = 8  # rows of the narrowest group Quickdraft's block kernels take (AVX2's 256 bits)


def group_rows(n: int) -> int:
    """Rows per group for a matrix of n rows: the widest the kernels take here (16 with
    AVX-512) where n fills such groups, else 8 (the last group padded where n needs it)."""
    widest = torch.ops.quickdraft.block_group_rows()
    return widest if n % widest == 0 else NARROW


def repack(rows: torch.Tensor, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed blocks, their int64 (type, rows per group)) for Quickdraft's kernels, from
    (N, bytes per row) uint8 rows of block type `kind`."""
    width = group_rows(rows.shape[0])
    packed = torch.ops.quickdraft.block_repack(rows, kind, width)
    return packed, torch.tensor([kind, width])


def fits(linear: nn.Linear, kind: str, device: torch.device) -> bool:
    """Whether the kernels take this layer's shape (others stay bf16)."""
    k, n = linear.in_features, linear.out_features
    if kind == "int8w":
        return True
    if device.type == "cuda":
        return _inner_tiles(k) > 0 and n % 8 == 0 and k % GROUP_SIZE == 0
    # Quickdraft's kernels take whole groups of rows, PyTorch's CPU packing N % 16
    return own_kernels(device, k, n, kind) or (k % GROUP_SIZE == 0 and n % 16 == 0)


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
    """Token embeddings read from a low-bit layer's codes: row t is the layer's row t in
    bf16, without a table of their own. The layer is the LM head where they are tied (the
    same values the head multiplies by; `head`, the model's module, not a child of this
    one), else a table of their own (`table`: a GGUF file's, engine/weights/gguf_blocks.py)."""

    def __init__(self, table: LowBitLinear, tied: bool = True):
        super().__init__()
        self.tied = tied
        if tied:
            self.head = [table]  # a list: not a child module
        else:
            self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    @property
    def source(self) -> LowBitLinear:
        return self.head[0] if self.tied else self.table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.source.rows(ids.reshape(-1)).to(torch.bfloat16)
        return rows.view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole (V, H) table, made on demand (what code reading a table gets)."""
        return self.forward(torch.arange(self.num_embeddings, device=self.source.packed.device))


def low_bit_layers(model: nn.Module) -> list[LowBitLinear]:
    return [m for m in model.modules() if isinstance(m, LowBitLinear)]


def set_wide_rows(model: nn.Module, rows: int) -> None:
    """Use the bf16 copies from `rows` rows on (0: never, and drop them)."""
    for layer in low_bit_layers(model):
        layer.wide_rows = rows
        if rows == 0:
            layer.wide = None
