"""Device, dtype and memory choices on the cards people own, checked on a CPU with faked
capabilities (tests/fake_devices.py): compute capability 6.1 / 7.5 / 8.6 / 8.9, free
memory, native bf16, Apple's GPU; and an out-of-memory error while loading read as one line."""

from __future__ import annotations

import pytest
import torch

from engine import devices
from engine.config import ModelSpec
from engine.errors import ModelLoadError
from engine.weights import memory_fit
from engine.weights.memory_fit import Checkpoint
from tests.fake_devices import (
    ADA,
    AMPERE,
    GB,
    PASCAL,
    TURING,
    FakeCard,
    fake_cuda,
    fake_mps,
    no_gpu,
)

# Checkpoints as their safetensors headers and configs describe them (bf16 on disk, as
# most are): (layer matrices, LM head (0: tied), token table, norms, stored bytes, dtype,
# layers, kv heads x head size, heads, context).
LLAMA_1B = Checkpoint(973_000_000, 0, 262_700_000, 100_000, 2_471_000_000, "BF16", 16, 512,
                      32, 131072)
LLAMA_3B = Checkpoint(2_800_000_000, 0, 394_000_000, 300_000, 6_430_000_000, "BF16", 28, 1024,
                      24, 131072)
QWEN_7B = Checkpoint(6_525_000_000, 545_000_000, 545_000_000, 400_000, 15_230_000_000, "BF16",
                     28, 512, 28, 32768)
LLAMA_8B = Checkpoint(6_980_000_000, 525_000_000, 525_000_000, 300_000, 16_060_000_000, "BF16",
                      32, 1024, 32, 131072)
CUDA = torch.device("cuda")


def _auto(monkeypatch, card: FakeCard, ck: Checkpoint, device: str = "auto"):
    fake_cuda(monkeypatch, card)
    return memory_fit.plan("auto", device, devices.pick_device(device), ck)


@pytest.mark.parametrize("card, half, tinygemm", [(PASCAL, "fp16", False), (TURING, "fp16", False),
                                                  (AMPERE, "bf16", True), (ADA, "bf16", True)])
def test_a_cards_half_precision_and_int4_kernel_follow_its_compute_capability(
        monkeypatch, card, half, tinygemm):
    pytest.importorskip("bitsandbytes")  # before torch.cuda is faked: its import reads it
    fake_cuda(monkeypatch, card)
    seen = devices.card(CUDA)
    assert (seen.capability, seen.half, seen.tinygemm) == (card.capability, half, tinygemm)
    assert seen.free_bytes == int(card.free_gb * GB) and seen.name == card.name
    expected = torch.float16 if half == "fp16" else torch.bfloat16
    for quant in ("bf16", "int4", "nf4"):  # activations of every choice but fp32 / fp16
        assert devices.compute_dtype(quant, CUDA) == expected
    assert devices.compute_dtype("fp32", CUDA) == torch.float32
    nf4 = devices.load_kwargs("nf4", CUDA)
    assert nf4["quantization_config"].bnb_4bit_compute_dtype == expected
    assert nf4["dtype"] == expected


@pytest.mark.parametrize("card, ck, chosen", [
    (PASCAL, LLAMA_1B, "fp16"),  # no native bf16 before 8.0
    (TURING, LLAMA_1B, "fp16"),
    (AMPERE, LLAMA_1B, "bf16"),
    (TURING, LLAMA_3B, "nf4"),  # 4 bits, and no tinygemm before 8.0
    (AMPERE, LLAMA_3B, "bf16"),
    (AMPERE, QWEN_7B, "int4"),  # 15 GB in bf16 > 11.2 GB free
    (ADA, QWEN_7B, "bf16"),
    (ADA, LLAMA_8B, "bf16"),
])
def test_auto_on_a_gpu_takes_the_largest_choice_that_fits_on_that_card(monkeypatch, card, ck,
                                                                       chosen):
    fit = _auto(monkeypatch, card, ck)
    assert (fit.quant, fit.device.type) == (chosen, "cuda")
    assert fit.reason.startswith(f"{chosen}: ") and card.name in fit.reason
    assert "bf16" in fit.reason and "stored in bf16" in fit.reason  # the table it chose from


def test_auto_sizes_a_bf16_checkpoint_by_its_parameters_not_half_its_file(monkeypatch):
    # 16 GB of bf16 weights: the file's size halved (8 GB) would fit in 12 GB and fail to load
    fit = _auto(monkeypatch, FakeCard("RTX 3080 Ti", (8, 6), 12, 12.0), LLAMA_8B)
    assert fit.quant == "int4"
    assert fit.needs["bf16"] > memory_fit.weights_bytes(LLAMA_8B, "bf16") > 14 * GB


def test_auto_leaves_room_for_the_kv_cache(monkeypatch):
    weights = memory_fit.weights_bytes(LLAMA_8B, "bf16")
    roomy = FakeCard("weights fit, their cache does not", (8, 9), 24, (weights + GB) / GB)
    assert _auto(monkeypatch, roomy, LLAMA_8B).quant == "int4"
    cache = 2 * 32 * 1024 * memory_fit.PLANNED_CONTEXT * 2  # layers x K,V x width x tokens
    assert memory_fit.runtime_bytes(LLAMA_8B, memory_fit.PLANNED_CONTEXT) > cache == GB


def test_a_model_that_fits_nowhere_on_the_gpu_runs_on_the_cpu_or_says_so(monkeypatch):
    fit = _auto(monkeypatch, TURING, QWEN_7B)  # 6.9 GB even in 4 bits, 5.5 GB free
    assert fit.device.type == "cpu" and "does not fit on the GPU" in fit.moved
    assert "nf4 needs" in fit.moved and "5.5 GB free" in fit.moved
    assert list(fit.needs) == ["bf16", "int8w", "int4"] and fit.free > 0  # the CPU's
    small = FakeCard("NVIDIA GeForce GT 1030", (6, 1), 2, 1.6)
    asked = _auto(monkeypatch, small, QWEN_7B, device="cuda")  # the GPU was asked for
    assert asked.device.type == "cuda" and "does not fit" in asked.reason


def test_int4_asked_on_a_card_before_ampere_runs_as_nf4_and_says_why(monkeypatch):
    fake_cuda(monkeypatch, TURING)
    fit = memory_fit.plan("int4", "auto", CUDA, LLAMA_1B)
    assert fit.quant == "nf4" and "compute capability 8.0" in fit.reason and "7.5" in fit.reason
    fake_cuda(monkeypatch, AMPERE)
    assert memory_fit.plan("int4", "auto", CUDA, LLAMA_1B).quant == "int4"
    assert memory_fit.plan("bf16", "auto", CUDA, QWEN_7B).quant == "bf16"  # asked: kept


def test_the_device_is_cuda_then_apples_gpu_then_the_cpu_and_says_why(monkeypatch):
    fake_cuda(monkeypatch, AMPERE)
    assert devices.pick_device("auto").type == "cuda"
    line = devices.device_line("auto", CUDA)
    assert "RTX 3060" in line and "compute capability 8.6" in line and "11.2 of 12.0 GB" in line
    fake_mps(monkeypatch, 16, bf16=True)
    assert devices.pick_device("auto").type == "mps"
    assert "Apple's GPU" in devices.device_line("auto", torch.device("mps"))
    no_gpu(monkeypatch)
    assert devices.pick_device("auto").type == "cpu"
    assert "this PyTorch is a CPU build" in devices.device_line("auto", torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="CPU build"):
        devices.pick_device("cuda")
    no_gpu(monkeypatch, cuda_build=True)
    with pytest.raises(ModelLoadError, match=r"CUDA 12\.8\) sees no GPU"):
        devices.pick_device("cuda")
    with pytest.raises(ModelLoadError, match="no Apple GPU"):
        devices.pick_device("mps")


def test_apples_gpu_runs_the_half_precision_it_has_and_sends_low_bit_to_the_cpu(monkeypatch):
    mps = torch.device("mps")
    fake_mps(monkeypatch, 16, bf16=False)  # macOS 13: no bf16 on the GPU
    assert memory_fit.plan("auto", "auto", mps, LLAMA_1B).quant == "fp16"
    assert devices.compute_dtype("bf16", mps) == torch.float16
    moved = memory_fit.plan("bf16", "auto", mps, LLAMA_1B)
    assert moved.device.type == "cpu" and "macOS 14" in moved.moved
    int4 = memory_fit.plan("int4", "auto", mps, LLAMA_1B)
    assert int4.device.type == "cpu" and "no kernels for Apple's GPU" in int4.moved
    with pytest.raises(ModelLoadError, match="choose fp32, fp16, bf16 on mps"):
        memory_fit.plan("int4", "mps", mps, LLAMA_1B)
    fake_mps(monkeypatch, 16, bf16=True)
    assert memory_fit.plan("auto", "auto", mps, LLAMA_1B).quant == "bf16"
    fake_mps(monkeypatch, 8, bf16=True)  # 8 GB of working set: 16 GB of bf16 weights go
    assert memory_fit.plan("auto", "auto", mps, LLAMA_8B).device.type == "cpu"


def test_a_checkpoint_is_read_from_its_headers_in_the_dtype_it_is_stored_in(tiny, tmp_path):
    params = sum(p.numel() for p in tiny.model.parameters())
    for dtype, name in ((torch.bfloat16, "BF16"), (torch.float32, "F32")):
        folder = tmp_path / name
        tiny.model.to(dtype).save_pretrained(folder)
        ck = memory_fit.read_checkpoint(folder)
        assert (ck.parameters, ck.dtype, ck.head) == (params, name, 0)  # tied: stored once
        config = tiny.model.config
        assert ck.layers == config.num_hidden_layers and ck.heads == config.num_attention_heads
        assert ck.kv_width == config.num_key_value_heads * config.head_dim
        assert ck.stored_bytes == params * (2 if name == "BF16" else 4)
        # the same weights in either file need the same memory once loaded
        assert memory_fit.weights_bytes(ck, "bf16") == params * 2


def test_out_of_memory_while_loading_is_one_line_with_what_fits(tiny, tmp_path, monkeypatch):
    from engine.model import loading

    folder = tmp_path / "Tiny-Chat-1B"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)

    def too_big(*args, **kwargs):
        torch.empty(1)  # the allocation that failed
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(loading, "_load_weights", too_big)
    with pytest.raises(ModelLoadError) as info:
        loading.load_model(ModelSpec(source=str(folder), quant="fp32", device="cpu"))
    line = str(info.value)
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("not enough memory on ") and "for Tiny-Chat-1B in fp32" in line
    assert "about " in line and "--quant bf16 needs about" in line  # a choice that fits
    fit = memory_fit.Fit("nf4", CUDA, "", {"bf16": 20 * GB, "nf4": 9 * GB}, 8 * GB)
    assert memory_fit.oom_line("m", fit, "RTX 2060").endswith("try --device cpu, or a smaller "
                                                              "model")


def test_low_bit_weights_reach_the_gpu_layer_by_layer_never_whole_in_bf16(tiny, tmp_path,
                                                                          monkeypatch):
    from engine.model import loading

    folder = tmp_path / "tiny"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    fake_cuda(monkeypatch, AMPERE)
    seen = []

    class Stop(Exception):
        pass

    def quantizing(model, kind, wide_rows=0, device=None):
        seen.append((kind, {p.device.type for p in model.parameters()}, device))
        raise Stop  # a CPU cannot pack for CUDA's kernels: what it was handed is the point

    monkeypatch.setattr(loading, "quantize_model", quantizing)
    with pytest.raises(Stop):
        loading.load_model(ModelSpec(source=str(folder), quant="int8w"))
    assert seen == [("int8w", {"cpu"}, CUDA)]  # still on the CPU, bound for the GPU


def test_quantizing_onto_another_device_moves_every_tensor_there(tiny):
    import copy

    from engine.weights import quant

    model = copy.deepcopy(tiny.model)
    quant.quantize_model(model, "int8w", device=torch.device("meta"))
    assert quant.low_bit_layers(model)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_a_layer_packed_for_one_devices_kernel_refuses_to_run_on_another():
    from engine.lean.layer_weights import fuse_low_bit
    from engine.weights import quant

    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    four = quant.LowBitLinear(quant.Codes.of(weight, "int4"), None, torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="packed for the cpu kernels .* --device meta"):
        four.to("meta")
    assert four.packed.device.type == "cpu"  # refused before anything moved
    fused = fuse_low_bit([four, quant.LowBitLinear(quant.Codes.of(weight, "int4"), None,
                                                   torch.device("cpu"))])
    if fused is not None:
        with pytest.raises(ModelLoadError, match="packed for the cpu kernels"):
            fused.to("meta")


def test_the_loaded_model_and_the_models_tab_say_which_device_runs_and_why(tiny, tmp_path,
                                                                            monkeypatch):
    from types import SimpleNamespace

    from app.ui.models import ModelsTab
    from engine.model import loading

    folder = tmp_path / "tiny"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    no_gpu(monkeypatch)  # an NVIDIA machine whose PyTorch is the CPU build
    lm = loading.load_model(ModelSpec(source=str(folder), quant="fp32", step="eager"))
    assert lm.device_line.startswith(f"cpu ({devices.cpu_name()}): no CUDA GPU: this PyTorch "
                                     "is a CPU build")
    tab = SimpleNamespace(service=SimpleNamespace(host=SimpleNamespace(lm=lm)))
    assert f"Device: {lm.device_line}" in ModelsTab.describe(tab)


def test_the_cpus_name_and_features_come_from_torchs_cpuinfo(monkeypatch):
    """Read the same way on Linux, Windows and macOS (no /proc/cpuinfo), in cpuinfo's names:
    what the kernels' compiler flags are chosen by. Its sizes and counts are no features."""
    from engine.weights import kernels

    fake = {"cpu_name": "Fake CPU", "avx2": True, "avx512_vnni": True, "avx512_vl": True,
            "amx_tile": False, "l1d_cache_size": 32768, "num_physical_cores": 2}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: fake)
    assert devices.cpu_name() == "Fake CPU"
    assert devices.cpu_flags() == {"avx2", "avx512_vnni", "avx512_vl"}
    assert kernels.vnni_flags() == ("-mavx512vnni", "-mavx512vl")


def test_every_cache_kept_per_machine_is_keyed_by_the_one_machine_reading(monkeypatch):
    """The kernel library, the compiled step packages, --quant auto's remembered choice and
    a calibration's record each change with devices.machine(), the one reading of this
    machine, where it differs."""
    import dataclasses
    from types import SimpleNamespace

    from engine.drafters import payoff
    from engine.lean import compiled
    from engine.weights import kernels, quant_auto

    lm = SimpleNamespace(device=torch.device("cpu"), quant="bf16")

    def keys(machine: devices.Machine) -> list:
        monkeypatch.setattr(devices, "machine", lambda device=None: machine)
        try:
            library = kernels._command_and_path()[1]
        except RuntimeError:  # no compiler or no AVX2 here: nothing is built to key
            library = None
        return [compiled.package_folder("a model"), quant_auto.machine_key("weights"),
                payoff.machine(lm), library]

    one = devices.Machine("2.13.0", "AVX512", ("avx2", "avx512_vnni"), "CPU A", 2)
    built = keys(dataclasses.replace(one, flags=("avx2",)))  # what code built here may use
    timed = keys(dataclasses.replace(one, processor="CPU B", threads=4))  # what timings read
    first = keys(one)
    assert first[0] != built[0] and (first[3] is None or first[3] != built[3])
    assert first[1] != timed[1] and first[2] != timed[2]
    assert first[0] == timed[0]  # packages are code: another thread count uses them
