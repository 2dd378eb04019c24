"""A GGUF file's quantized blocks as layers, kept as the file stores them: a linear layer
multiplies by them directly (engine/weights/kernels/blocks.cpp; the formats are
engine/weights/kernels/formats.h), and a token table looks its rows up in them. Nothing is
ever expanded to a float copy of the weights: the kernels read a repack of the file's
blocks that has their size (a group of rows side by side, so that one vector register holds
one 4-byte word of each).

The formats (GGML types) are the library's own table (`formats`): Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K and Q6_K, what Q4_K_M, Q5_K_M, Q6_K and Q8_0 files hold.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.weights import kernels
from engine.weights.quant import CodedEmbedding, LowBitLinear, repack


def formats() -> dict[str, int]:
    """{GGML type name: type id} the block kernels read ({} where they are unavailable;
    Quickdraft's own int8w format, not a GGML type, is not listed)."""
    if not kernels.available():
        return {}
    from gguf import GGMLQuantizationType

    ggml = {t.value for t in GGMLQuantizationType}
    return {GGMLQuantizationType(t).name: t for t in torch.ops.quickdraft.block_types()
            if t in ggml}


class BlockLinear(LowBitLinear):
    """An nn.Linear whose weights are a GGUF file's own blocks of one GGML type (`kind`):
    a low-bit layer on Quickdraft's block kernels, built from the file's rows rather than
    from codes.

    `packed`: (N', bytes per row) uint8, the file's rows repacked for the kernel in groups
    of 8 or 16 rows (N' is N rounded up to whole groups; rows past N are zero blocks);
    `scales`: (type id, rows per group) as int64, what the block kernel reads."""

    def __init__(self, packed: torch.Tensor, meta: torch.Tensor, kind: str, out_features: int,
                 in_features: int, bias: torch.Tensor | None = None):
        nn.Module.__init__(self)
        self.kind = kind
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), False)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", meta)  # (type id, rows per group)
        self.wide, self.wide_rows = None, 0  # no float copies of block weights
        self.packed_for, self.kernel = "cpu", "blocks"  # Quickdraft's CPU kernels read them

    @classmethod
    def from_rows(cls, rows: torch.Tensor, kind: str, in_features: int,
                  bias: torch.Tensor | None = None) -> BlockLinear:
        """From the file's rows, (N, bytes per row) uint8, in the order the layer's outputs
        take them."""
        packed, meta = repack(rows, formats()[kind])
        return cls(packed, meta, kind, rows.shape[0], in_features, bias)


class BlockEmbedding(CodedEmbedding):
    """Token embeddings looked up in a GGUF file's token table as stored: a table of its own,
    or the LM head's when the file ties them."""
