"""The low-bit kernels a layer's weights can run on, one table (KERNELS), and the weights
as one kernel takes them (LowBitWeights): engine/weights/quant.py packs them, the lean
step's layer function and its compiled packages multiply by them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

GROUP_SIZE = 32  # int4: inputs sharing one scale and zero point (as Q4_1)


def _blocks_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.quickdraft.block_linear(x, packed, scales)


def _int8_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu" and packed.shape[1] % 16:
        # PyTorch's CPU kernel crashes (segfault) on such widths for 2 rows or more on some
        # CPUs (a Xeon with AVX-512 and AMX, torch 2.13): the same product, dequantized.
        return ((x.float() @ packed.float().T) * scales.float()).to(x.dtype)
    return torch._weight_int8pack_mm(x, packed, scales)


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP_SIZE, scales)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP_SIZE, scales)


# Every low-bit kernel, by the name a layer's weights carry: Quickdraft's blocks (a GGUF
# file's, or int4's and int8w's own; `scales` holds their type and group width), PyTorch's
# int8 (per-row bf16 scales) and int4 (tinygemm's packing, per-group scales and zeros).
KERNELS = {"blocks": _blocks_mm, "int8": _int8_mm, "int4": _int4_mm}


@dataclass(frozen=True)
class LowBitWeights:
    """A layer's low-bit weights as one kernel takes them, and which kernel (chosen once,
    where they are packed for a device, and carried with them: through a compiled step
    too, where `kernel` is static pytree context, so a package is keyed by it)."""

    packed: torch.Tensor
    scales: torch.Tensor
    kernel: str  # a key of KERNELS

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """(M, K) -> (M, N)."""
        return KERNELS[self.kernel](x, self.packed, self.scales)


pytree.register_pytree_node(
    LowBitWeights, lambda w: ([w.packed, w.scales], w.kernel),
    lambda leaves, kernel: LowBitWeights(*leaves, kernel),
    serialized_type_name="quickdraft.LowBitWeights")
