"""The GGUF block kernels (engine/weights/kernels/blocks.cpp, formats.h) on random blocks of every
format: the rows they read are gguf's own dequantized values bit for bit, their products
are the block-quantized activations times those values (the same arithmetic in PyTorch),
and a row's result has the same bits in a step of any size, in either vector width, with or
without VNNI."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.weights import gguf_blocks, kernels
from engine.weights.gguf_blocks import BlockLinear
from tests.engine.weights.test_kernels import quantized

built = pytest.mark.skipif(not kernels.available(),
                           reason=f"kernels not built here: {kernels.problem}")
FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# where each format keeps its float16 scale, and its low or dmin (if any)
SCALES = {"Q6_K": (208, None), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}


def random_rows(kind: str, n: int, k: int, seed: int, scale: float = 0.03) -> np.ndarray:
    """(n, bytes per row) random blocks of `kind` with finite float16 scales of up to `scale`
    (the codes, sub-scales and high bits are random bytes, as any value of them is valid)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    elems, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    halves = lambda v: v.astype(np.float16)[..., None].view(np.uint8)  # noqa: E731
    at, low = SCALES.get(kind, (0, None))
    blocks[..., at:at + 2] = halves(rng.uniform(-scale, scale, blocks.shape[:2]))
    if low is not None:
        blocks[..., low:low + 2] = halves(rng.uniform(-scale, scale, blocks.shape[:2]) / 2)
    return blocks.reshape(n, -1)


def gguf_values(kind: str, rows: np.ndarray, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(rows, GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(rows.shape[0], k)


@built
@pytest.mark.parametrize("kind", FORMATS)
def test_a_layer_reads_gguf_values_and_multiplies_by_them(kind):
    k = 512
    rows = random_rows(kind, 44, k, seed=FORMATS.index(kind))  # 44: the last group padded
    want = gguf_values(kind, rows, k)
    layer = BlockLinear.from_rows(torch.from_numpy(rows), kind, k)
    assert int(layer.scales[1]) == 8  # groups of 16 rows only where the rows fill them
    assert layer.packed.shape == (48, rows.shape[1])  # the file's bytes, and 4 zero rows
    assert torch.equal(layer.rows(torch.arange(44)), want)  # bit for bit, signs of zero too
    assert torch.equal(layer.rows(torch.arange(44)).view(torch.int32), want.view(torch.int32))
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1)) * 2
    x[0, :32] = 0  # a block of zeros has scale 0
    for dtype, tolerance in ((torch.float32, 2e-6), (torch.bfloat16, 8e-3)):
        out = layer.low_bit(x.to(dtype))  # the kernel itself (the layer casts to bf16)
        assert out.dtype == dtype and out.shape == (6, 44)
        reference = quantized(x.to(dtype)) @ want.double().t()
        assert ((out.double() - reference).abs().max() / reference.abs().max()) < tolerance


@built
@pytest.mark.parametrize("kind", FORMATS)
def test_a_row_gives_the_same_bits_in_a_step_of_any_size_and_group_width(kind):
    """Drafted steps verify several tokens at once: each must get exactly what a plain step
    of that token alone would (the arithmetic of a row never depends on the others), and
    groups of 8 or 16 rows (256- or 512-bit registers) compute the same lanes alike."""
    rows = torch.from_numpy(random_rows(kind, 32, 768, seed=7))
    layer = BlockLinear.from_rows(rows, kind, 768)
    x = torch.randn(13, 768, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    whole = layer(x)
    for size in (1, 2, 3, 4, 5):
        for i in range(0, 13 - size + 1, size):
            assert torch.equal(whole[i:i + size], layer(x[i:i + size]))
    kind_id = gguf_blocks.formats()[kind]
    narrow = torch.ops.quickdraft.block_repack(rows, kind_id, 8)
    assert torch.equal(torch.ops.quickdraft.block_linear(x, narrow, torch.tensor([kind_id, 8])),
                       layer.low_bit(x))


def q6_k_rows(codes: np.ndarray) -> np.ndarray:
    """Q6_K blocks (one per row) of 6-bit `codes` (rows, 256), in gguf's layout (per 128
    values: 64 bytes of low nibbles, 32 of top 2-bit pairs), sub-scales 1 and d 1."""
    ql = np.zeros((len(codes), 128), np.uint8)
    qh = np.zeros((len(codes), 64), np.uint8)
    for h in range(2):
        c = codes[:, 128 * h:128 * h + 128].reshape(-1, 4, 32)  # part i: values 32i + l
        ql[:, 64 * h:64 * h + 32] = (c[:, 0] & 15) | (c[:, 2] & 15) << 4
        ql[:, 64 * h + 32:64 * h + 64] = (c[:, 1] & 15) | (c[:, 3] & 15) << 4
        qh[:, 32 * h:32 * h + 32] = sum((c[:, i] >> 4) << 2 * i for i in range(4))
    tail = np.tile(np.array([1] * 16 + list(np.float16(1).tobytes()), np.uint8), (len(codes), 1))
    return np.concatenate([ql, qh, tail], axis=1)


def _stored_at(c: int, o: int) -> int:
    """Where row c's byte o of a Q6_K block lies in a repacked unit of 8 rows: the rows'
    words at o (4 bytes; d's, 2) side by side."""
    return 8 * (o - o % 4) + 4 * c + o % 4 if o < 208 else 8 * 208 + 2 * c + o - 208


@built
def test_q6_k_codes_are_stored_six_bits_to_a_byte_for_the_kernel():
    """The repack stores each Q6_K block of 32 values as 24 bytes a row: bytes 0..15 hold
    codes 0..15 whole, with the top 2 bits of codes 16..31 above them; bytes 16..23 the low
    nibbles of codes 16..31 (the kernel then unpacks half the words with one AND)."""
    codes = np.random.default_rng(5).integers(0, 64, (8, 256), dtype=np.uint8)
    rows = q6_k_rows(codes)
    assert torch.equal(gguf_values("Q6_K", rows, 256), torch.from_numpy(codes - 32.0))
    unit = torch.ops.quickdraft.block_repack(torch.from_numpy(rows), 14, 8).numpy().reshape(-1)
    stored = np.array([[unit[_stored_at(c, o)] for o in range(210)] for c in range(8)])
    for j in range(8):
        c = codes[:, 32 * j:32 * j + 32]
        block = stored[:, 24 * j:24 * j + 24]
        assert np.array_equal(block[:, :16], c[:, :16] | (c[:, 16:] >> 4) << 6)
        assert np.array_equal(block[:, 16:20], (c[:, 16:20] & 15) | (c[:, 20:24] & 15) << 4)
        assert np.array_equal(block[:, 20:24], (c[:, 24:28] & 15) | (c[:, 28:32] & 15) << 4)
    assert np.array_equal(stored[:, 192:], rows[:, 192:])  # sub-scales and d as stored


NARROW = '''
import sys, torch
from engine.weights import gguf_blocks, kernels
kernels._cpu_flags = lambda: {"avx2"}
assert kernels.vnni_flags() == () and kernels.wide_flags() == () and kernels.available()
assert torch.ops.quickdraft.block_group_rows() == 8, kernels.problem
rows, x = torch.load(sys.argv[1])
out = {kind: gguf_blocks.BlockLinear.from_rows(r, kind, 512)(x) for kind, r in rows.items()}
torch.save(out, sys.argv[1])
'''


@built
def test_the_kernels_without_vnni_or_wide_registers_give_the_same_bits(tmp_path):
    """A CPU with AVX2 alone reads 8 rows at a time with other instructions, to the same
    integers and the same float operations: a machine's answers must not depend on which
    of the two it has."""
    rows = {kind: torch.from_numpy(random_rows(kind, 48, 512, seed=3)) for kind in FORMATS}
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    path = tmp_path / "tensors.pt"
    torch.save((rows, x), path)
    subprocess.run([sys.executable, "-c", NARROW, str(path)], check=True, timeout=600)
    narrow = torch.load(path)
    for kind, r in rows.items():
        assert torch.equal(BlockLinear.from_rows(r, kind, 512)(x), narrow[kind]), kind


@built
def test_the_format_table_is_the_libraries_and_bad_input_is_refused():
    assert set(FORMATS) == set(gguf_blocks.formats())
    layer = BlockLinear.from_rows(torch.from_numpy(random_rows("Q4_0", 16, 64, 0)), "Q4_0", 64)
    with pytest.raises(RuntimeError, match="blocks"):
        torch.ops.quickdraft.block_linear(torch.randn(1, 96), layer.packed, layer.scales)
    other = torch.tensor([2, 4])  # repacked for groups of another width
    with pytest.raises(RuntimeError, match="repacked for groups of 4 rows"):
        torch.ops.quickdraft.block_linear(torch.randn(1, 64), layer.packed, other)
    with pytest.raises(RuntimeError, match="no kernel for GGML block type 99"):
        torch.ops.quickdraft.block_repack(torch.zeros(8, 18, dtype=torch.uint8), 99, 8)
