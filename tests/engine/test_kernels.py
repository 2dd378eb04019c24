"""Quickdraft's CPU kernel (engine/kernels): int8 weights x activations quantized to int8 per
block of 32, against the same arithmetic written out in PyTorch."""

from __future__ import annotations

import pytest
import torch

from engine import kernels, quant

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"kernels not built here: {kernels.problem}")


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each row quantized per block of 32 (scale = block max / 127, rounded half to even),
    then multiplied by the int8 weights and their row scales, in float64."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks))
    a = (q * d).reshape(m, k).double()
    return a @ (codes.double() * scale.double()[:, None]).t()


@pytest.mark.parametrize("m,k,n", [(1, 576, 96), (3, 1536, 40), (9, 64, 7), (16, 32, 33),
                                   (2, 96, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_block_quantized_activations_times_the_weights(m, k, n, dtype):
    g = torch.Generator().manual_seed(m * k + n)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, :32] = 0  # a block of zeros has scale 0
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) + 0.01
    out = torch.ops.quickdraft.q8_linear(x, codes, scale)
    assert out.dtype == dtype and out.shape == (m, n)
    want = reference(x, codes, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # bf16 output rounding
    assert ((out.double() - want).abs() / want.abs().max()).max() < tolerance


def test_a_row_gives_the_same_bits_in_a_step_of_any_size():
    """Drafted steps verify several tokens at once: each must get exactly what a plain step
    of that token alone would (the arithmetic of a row never depends on the others)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 576, generator=g).to(torch.bfloat16)
    codes = torch.randint(-127, 128, (200, 576), dtype=torch.int8, generator=g)
    scale = torch.rand(200, generator=g)
    whole = torch.ops.quickdraft.q8_linear(x, codes, scale)
    for i in range(13):
        assert torch.equal(whole[i], torch.ops.quickdraft.q8_linear(x[i:i + 1], codes, scale)[0])


def test_int8_layers_use_it_and_stay_close_to_their_dense_weights():
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(256, 48, bias=True)
    layer = quant.LowBitLinear.from_linear(linear, "int8w", torch.device("cpu"))
    assert layer.scales.dtype == torch.float32  # the mark of this kernel's layout
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    want = x.float() @ layer.dequantized().float().t() + linear.bias.float()
    got = layer(x).float()
    assert ((got - want).abs().max() / want.abs().max()) < 0.02


def test_shapes_the_kernel_cannot_take_keep_pytorchs():
    layer = quant.LowBitLinear.from_linear(torch.nn.Linear(40, 8), "int8w", torch.device("cpu"))
    assert layer.scales.dtype == torch.bfloat16
    assert layer(torch.randn(2, 40, dtype=torch.bfloat16)).shape == (2, 8)


def test_bad_arguments_are_refused_with_a_message():
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.quickdraft.q8_linear(torch.randn(1, 40), torch.zeros(3, 40, dtype=torch.int8),
                                       torch.ones(3))
    with pytest.raises(RuntimeError, match="float32 scales"):
        torch.ops.quickdraft.q8_linear(torch.randn(1, 32), torch.zeros(3, 32, dtype=torch.int8),
                                       torch.ones(3, dtype=torch.bfloat16))


def test_a_failed_build_keeps_pytorchs_kernels(monkeypatch, tmp_path):
    """No compiler (or any failure): one logged reason, and int8 layers on PyTorch's kernel."""
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "cache_dir", lambda: tmp_path)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert not kernels.available()
    assert "no-such-compiler" in kernels.problem or "FileNotFoundError" in kernels.problem
    layer = quant.LowBitLinear.from_linear(torch.nn.Linear(64, 8), "int8w", torch.device("cpu"))
    assert layer.scales.dtype == torch.bfloat16
    assert layer(torch.randn(1, 64, dtype=torch.bfloat16)).shape == (1, 8)
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind
