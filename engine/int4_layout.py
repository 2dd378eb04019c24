"""Quickdraft's int4 kernel's weight layout (CPU; engine/kernels/lowbit.cpp): llama.cpp's
Q4_1 blocks (a byte of a block holds value i in its low nibble and i + 16 in its high one;
a float16 scale and low per block: 0.625 bytes per weight in all) in the order the kernel
reads them. Per group of ROWS rows, block by block, each block's 4-byte words of the rows
side by side (word g of row c at [group, block, g, c]), then the group's scales and lows
per block (scale of row c at [group, block, 0, c], low at [group, block, 1, c]): the kernel
computes ROWS outputs at once, one per vector lane, and reads them with plain loads.
Shapes stay (N, K/2) bytes and (N, 2, K/BLOCK) halves, so layers stack and slice by whole
groups."""

from __future__ import annotations

import torch

BLOCK = 32  # input features sharing one scale and low (Q4_1's block)
ROWS = 8  # outputs the kernel computes at once: N must be a multiple


def pack(values: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) in the kernel's layout from (N, K) codes 0..15 and (N, K/BLOCK)
    scales and lows (w = code * scale + low)."""
    n, k = values.shape
    blocks = k // BLOCK
    values = values.reshape(n, blocks, BLOCK).to(torch.uint8)
    half = BLOCK // 2
    packed = (values[..., :half] | values[..., half:] << 4)  # (N, blocks, 16)
    packed = packed.reshape(n // ROWS, ROWS, blocks, 4, 4)
    packed = packed.permute(0, 2, 3, 1, 4).reshape(n, k // 2).contiguous()
    scales = torch.stack([scale.half(), low.half()], 1)  # (N, 2, blocks)
    scales = scales.reshape(n // ROWS, ROWS, 2, blocks)
    return packed, scales.permute(0, 3, 2, 1).reshape(n, 2, blocks).contiguous()


def dense(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(N, K) float32 weights from `pack`'s layout."""
    n, k = packed.shape[0], packed.shape[1] * 2
    blocks = k // BLOCK
    words = packed.reshape(n // ROWS, blocks, 4, ROWS, 4)
    pairs = words.permute(0, 3, 1, 2, 4).reshape(n, blocks, BLOCK // 2)
    values = torch.cat([pairs & 15, pairs >> 4], -1).float()
    grouped = scales.reshape(n // ROWS, blocks, 2, ROWS)
    scale, low = grouped.permute(0, 3, 2, 1).reshape(n, 2, blocks).float().unbind(1)
    return (values * scale[..., None] + low[..., None]).reshape(n, k)
