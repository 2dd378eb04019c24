"""Quickdraft's CPU kernels (engine/weights/kernels) for its own int8w and int4 layers: weights x
activations quantized to int8 per block of 32, against the same arithmetic written out in
PyTorch (the GGUF formats': tests/engine/weights/test_block_kernels.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.lean.layer_weights import fuse_low_bit
from engine.weights import kernels, quant

built = pytest.mark.skipif(not kernels.available(),
                           reason=f"kernels not built here: {kernels.problem}")


def quantized(x: torch.Tensor) -> torch.Tensor:
    """Each row quantized per block of 32 (scale = block max / 127, rounded half to even)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks))
    return (q * d).reshape(m, k).double()


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The quantized rows times the int8 weights and their row scales, in float64."""
    return quantized(x) @ (codes.double() * scale.double()[:, None]).t()


def int8_layer(codes: torch.Tensor, scale: torch.Tensor) -> quant.LowBitLinear:
    return quant.LowBitLinear(quant.Codes("int8w", codes, scale.to(torch.bfloat16)), None,
                              torch.device("cpu"))


@pytest.mark.parametrize("m,k,n", [(1, 576, 96), (3, 1536, 40), (9, 64, 7), (16, 32, 33),
                                   (2, 96, 1)])
@built
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_block_quantized_activations_times_the_weights(m, k, n, dtype):
    g = torch.Generator().manual_seed(m * k + n)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, :32] = 0  # a block of zeros has scale 0
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = (torch.rand(n, generator=g) + 0.01).to(torch.bfloat16).float()
    layer = int8_layer(codes, scale)
    assert layer.blocks  # Quickdraft's kernel, any number of outputs
    out = layer.low_bit(x)  # the kernel itself (the layer casts to bf16)
    assert out.dtype == dtype and out.shape == (m, n)
    want = reference(x, codes, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # bf16 output rounding
    assert ((out.double() - want).abs() / want.abs().max()).max() < tolerance


@built
@pytest.mark.parametrize("m,k,n", [(1, 576, 96), (3, 1536, 40), (9, 64, 8), (16, 288, 32)])
def test_the_int4_kernel_is_quantized_activations_times_the_4_bit_weights(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g) * 3
    weight = torch.randn(n, k, generator=g)
    codes = quant.Codes.of(weight, "int4")
    layer = quant.LowBitLinear(codes, None, torch.device("cpu"))
    assert layer.blocks and layer.packed.shape == (n, k // 32 * 20)  # Q4_1's 20 bytes a block
    # half-precision scales and lows, as llama.cpp's Q4_1 blocks
    halved = dataclasses.replace(codes, scale=codes.scale.half().float(),
                                 low=codes.low.half().float())
    assert torch.equal(layer.dequantized(), halved.dense(torch.bfloat16))
    out = layer.low_bit(x)
    want = quantized(x) @ halved.dense(torch.float64).t()
    assert ((out.double() - want).abs() / want.abs().max()).max() < 1e-5


@built
def test_a_row_gives_the_same_bits_in_a_step_of_any_size():
    """Drafted steps verify several tokens at once: each must get exactly what a plain step
    of that token alone would (the arithmetic of a row never depends on the others)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 576, generator=g).to(torch.bfloat16)
    codes = torch.randint(-127, 128, (200, 576), dtype=torch.int8, generator=g)
    eight = int8_layer(codes, torch.rand(200, generator=g))
    whole = eight(x)
    four = quant.LowBitLinear(quant.Codes.of(torch.randn(208, 576, generator=g), "int4"), None,
                              torch.device("cpu"))
    whole4 = four(x)
    for size in (1, 2, 3, 5):  # steps of one and two rows take another path through the kernel
        for i in range(0, 13 - size + 1, size):
            part = x[i:i + size]
            assert torch.equal(whole[i:i + size], eight(part))
            assert torch.equal(whole4[i:i + size], four(part))


NO_VNNI = '''
import sys, torch
from engine.weights import kernels, quant
kernels._cpu_flags = lambda: {"avx2"}
assert kernels.vnni_flags() == () and kernels.available(), kernels.problem
x, codes, scale, weight = torch.load(sys.argv[1])
cpu = torch.device("cpu")
eight = quant.LowBitLinear(quant.Codes("int8w", codes, scale.bfloat16()), None, cpu)
four = quant.LowBitLinear(quant.Codes.of(weight, "int4"), None, cpu)
torch.save((eight(x), four(x)), sys.argv[1])
'''


@built
def test_the_kernels_without_vnni_give_the_same_bits(tmp_path):
    """A CPU without VNNI (and without AVX-512: 8 outputs per register, not 16) takes other
    instructions to the same integers and the same float operations (a machine's answers
    must not depend on which it has)."""
    import subprocess
    import sys

    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 576, generator=g).to(torch.bfloat16)
    codes = torch.randint(-127, 128, (45, 576), dtype=torch.int8, generator=g)
    scale, weight = torch.rand(45, generator=g), torch.randn(48, 576, generator=g)
    path = tmp_path / "tensors.pt"
    torch.save((x, codes, scale, weight), path)
    subprocess.run([sys.executable, "-c", NO_VNNI, str(path)], check=True, timeout=600)
    want8, want4 = torch.load(path)
    four = quant.LowBitLinear(quant.Codes.of(weight, "int4"), None, torch.device("cpu"))
    assert torch.equal(int8_layer(codes, scale)(x), want8)
    assert torch.equal(four(x), want4)


@built
@pytest.mark.parametrize("kind", ["int8w", "int4"])
def test_low_bit_layers_use_them_and_stay_close_to_their_dense_weights(kind):
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(256, 48, bias=True)
    layer = quant.LowBitLinear.from_linear(linear, kind, torch.device("cpu"))
    assert layer.blocks
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    want = x.float() @ layer.dequantized().float().t() + linear.bias.float()
    got = layer(x).float()
    assert ((got - want).abs().max() / want.abs().max()) < 0.02


@built
def test_fused_int4_projections_are_the_projections_side_by_side():
    layers = [quant.LowBitLinear.from_linear(torch.nn.Linear(64, n), "int4",
                                             torch.device("cpu")) for n in (32, 16, 16)]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    apart = torch.cat([m(x) for m in layers], -1)
    fused = fuse_low_bit(layers)
    assert fused is not None and torch.equal(fused(x), apart)
    assert torch.equal(torch.cat([m(x) for m in layers], -1), apart)  # views of the fused


@built
def test_shapes_the_kernel_cannot_take_keep_pytorchs():
    layer = quant.LowBitLinear.from_linear(torch.nn.Linear(40, 8), "int8w", torch.device("cpu"))
    assert layer.scales.dtype == torch.bfloat16
    assert layer(torch.randn(2, 40, dtype=torch.bfloat16)).shape == (2, 8)
    # int4 outputs come 8 or 16 at a time (and PyTorch's kernel takes 16): 12 stay in bf16
    cpu = torch.device("cpu")
    assert not quant.fits(torch.nn.Linear(64, 12), "int4", cpu)
    assert quant.fits(torch.nn.Linear(64, 32), "int4", cpu)


@built
def test_a_failed_build_keeps_pytorchs_kernels(monkeypatch, tmp_path):
    """No compiler (or any failure): one logged reason, and int8 layers on PyTorch's kernel."""
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "_registered", lambda: False)  # as in a new process
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert not kernels.available()
    assert "no-such-compiler" in kernels.problem or "FileNotFoundError" in kernels.problem
    layer = quant.LowBitLinear.from_linear(torch.nn.Linear(64, 8), "int8w", torch.device("cpu"))
    assert layer.scales.dtype == torch.bfloat16
    assert layer(torch.randn(1, 64, dtype=torch.bfloat16)).shape == (1, 8)
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind


def test_the_kernels_build_where_a_compiler_and_avx2_are_there():
    """Where they can be built they are (the tests above would otherwise skip silently)."""
    import shutil

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    if not shutil.which("g++") and not shutil.which("c++"):
        pytest.skip("no C++ compiler here")
    assert kernels.available(), kernels.problem


@pytest.mark.parametrize("cpu, flags", [
    ({"avx2", "avx_vnni", "avx512_vnni", "avx512_vl"}, ("-mavxvnni",)),
    ({"avx2", "avx512_vnni", "avx512_vl"}, ("-mavx512vnni", "-mavx512vl")),
    ({"avx2", "avx512_vnni"}, ()),  # the 256-bit form needs VL
    ({"avx2"}, ()),
])
def test_the_vnni_dot_product_is_built_in_where_the_cpu_has_one(cpu, flags, monkeypatch):
    monkeypatch.setattr(kernels, "_cpu_flags", lambda: cpu)
    assert kernels.vnni_flags() == flags


@pytest.mark.parametrize("softcap, window", [(0.0, 0), (5.0, 0), (0.0, 13)])
def test_decode_attention_is_each_rows_softmax_over_its_own_positions(softcap, window):
    """The batched rows' attention (engine/weights/kernels/attention.cpp) over float32 caches: each
    row's query heads against its own first `length` positions (the last `window` of them
    where set), from one position to the cache's whole capacity."""
    if not kernels.available():
        pytest.skip(f"kernels not built here: {kernels.problem}")
    g = torch.Generator().manual_seed(0)
    rows, kv, groups, capacity, d = 5, 2, 3, 40, 16
    q = torch.randn(rows, kv * groups, d, generator=g)
    keys, values = (torch.randn(rows, kv, capacity, d, generator=g) for _ in range(2))
    lengths = torch.tensor([1, 7, 8, 17, 40])
    got = torch.ops.quickdraft.decode_attention(q, keys, values, lengths, 0.25, softcap, window)
    for r, n in enumerate(lengths.tolist()):
        first = max(0, n - window) if window else 0
        k = keys[r, :, first:n].float().repeat_interleave(groups, 0)  # (heads, n, D)
        v = values[r, :, first:n].float().repeat_interleave(groups, 0)
        scores = (q[r][:, None] @ k.transpose(1, 2))[:, 0] * 0.25
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        want = (torch.softmax(scores, -1)[:, None] @ v)[:, 0]
        torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-5)
