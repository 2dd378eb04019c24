"""A quantized GGUF file keeps its bits: its 4-bit layers load into the int4 kernel from the
file's own blocks (never expanded to an fp32 folder), 8-bit ones into the int8 kernel; fp32
and bf16 expand the same codes; accelerators attach by the file's own fingerprint."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine import gguf as qd_gguf
from engine import lowbit_folder, quant_auto
from engine.benchmark.gguf_writer import write_gguf
from engine.config import ModelSpec
from engine.errors import ModelLoadError
from engine.loading import load_model, resolve_folder
from engine.quant import LowBitLinear
from tests.engine.gguf.test_gguf import tiny_llama

# GGUF tensor -> HF module, and the type each is written in (the rest stays F32)
Q4 = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj",
      "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj",
      "blk.1.ffn_up.weight": "model.layers.1.mlp.up_proj"}
Q8 = {"blk.1.ffn_gate.weight": "model.layers.1.mlp.gate_proj"}
TYPES = {**{k: "Q4_0" for k in Q4}, **{k: "Q8_0" for k in Q8}}


@pytest.fixture(scope="module")
def quantized_file(tmp_path_factory):
    """The tiny Llama with four layers stored Q4_0/Q8_0, and gguf's own dequantized values."""
    import gguf
    from gguf import GGMLQuantizationType, quants

    from engine.benchmark.gguf_writer import tokenizer_fields

    path = tmp_path_factory.mktemp("lowbit") / "tiny-q4.gguf"
    want, real_add = {}, gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, *args, **kwargs):
        if name not in TYPES:
            return real_add(self, name, tensor, *args, **kwargs)
        qtype = GGMLQuantizationType[TYPES[name]]
        data = quants.quantize(tensor, qtype)
        want[name] = torch.from_numpy(quants.dequantize(data, qtype).copy())
        return real_add(self, name, data, raw_dtype=qtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
        write_gguf(path, tiny_llama(), tokenizer_fields())
    return path, want


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: the file is converted once."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qd_gguf, "cache_dir", lambda: root)
        yield root


@pytest.fixture(scope="module")
def expanded(quantized_file, tmp_path_factory):
    """The same file expanded to fp32 the way the bundled model is (the reference)."""
    target = tmp_path_factory.mktemp("expanded") / "tiny-fp32"
    qd_gguf.convert(quantized_file[0], target, keep_bits=False)
    return load_model(ModelSpec(str(target), "fp32", device="cpu"))


def test_four_bit_layers_run_on_the_int4_kernel_from_the_files_own_blocks(quantized_file,
                                                                           expanded, cache):
    path, _ = quantized_file
    folder, _ = resolve_folder(ModelSpec(str(path)))
    manifest = json.loads((folder / lowbit_folder.MANIFEST).read_text())
    assert manifest["layers"] == {**{m: "int4" for m in Q4.values()},
                                  **{m: "int8" for m in Q8.values()}}
    assert manifest["exact"] == sorted(Q4.values())  # Q8_0 runs on per-row int8 codes
    assert not (folder / "model.safetensors").exists()  # no fp32 expansion in the cache
    lm = load_model(ModelSpec(str(path), "auto", device="cpu"))
    assert lm.quant == "int4" and "kept as stored" in lm.quant_reason
    modules = dict(lm.model.named_modules())
    for name, module in {**Q4, **Q8}.items():
        layer = modules[module]
        assert isinstance(layer, LowBitLinear)
        assert layer.kind == ("int4" if name in Q4 else "int8w")
    reference = expanded.model.state_dict()
    for module in Q4.values():  # Q4_0 blocks are exactly int4 codes: only bf16 scales
        ref = reference[f"{module}.weight"]
        got = modules[module].dequantized().float()
        scale = ref.abs().reshape(ref.shape[0], -1, 32).amax(-1, keepdim=True) / 8
        err = ((got - ref).reshape(ref.shape[0], -1, 32).abs() / scale).amax()
        assert err < 2 ** -4  # bf16 rounding of the scale (<= 8 codes x 2^-8), not 4-bit
    assert not isinstance(modules["model.layers.0.mlp.up_proj"], LowBitLinear)  # F32 stays


def test_fp32_expands_the_same_codes_and_the_fingerprint_is_the_files(quantized_file,
                                                                       expanded, cache):
    path, want = quantized_file
    lm = load_model(ModelSpec(str(path), "fp32", device="cpu"))
    state = lm.model.state_dict()
    for name, module in Q8.items():  # not permuted: gguf's own dequantized values
        assert torch.equal(state[f"{module}.weight"], want[name])
    # Q4_0 and Q8_0 blocks are kept exactly: the expansion is the fp32 one, bit for bit
    reference = expanded.model.state_dict()
    assert state.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(state[key], value), key
    assert lm.fingerprint == expanded.fingerprint  # accelerators trained on either attach


def test_auto_keeps_the_files_own_format_unless_the_gate_refuses_it(quantized_file, cache,
                                                                    monkeypatch):
    """Not kept exactly (its Q8_0 layer runs on per-row int8 codes): the own format is
    checked against the file's weights expanded, in bounded time, and kept when admitted;
    refused, the expanded weights run."""
    path, _ = quantized_file
    said = []
    lm = load_model(ModelSpec(str(path), "auto", device="cpu", requantize=True), said.append)
    choice = lm.quant_choice
    assert choice.quant == quant_auto.OWN and set(choice.records) == {"bf16", quant_auto.OWN}
    assert choice.questions > 0 and not any(r["ms"] for r in choice.records.values())
    assert lm.quant == "int4" and "kept as stored" in lm.quant_reason
    assert any("checking own's answers" in m for m in said)
    monkeypatch.setattr(quant_auto, "admitted", lambda right, ppl, reference, **_k: [reference])
    refused = load_model(ModelSpec(str(path), "auto", device="cpu", requantize=True))
    assert refused.quant == "bf16" and refused.quant_choice.quant == "bf16"
    assert "own refused" in refused.quant_reason
    assert not any(isinstance(m, LowBitLinear) for m in refused.model.modules())
    # remembered: the next start loads the expanded weights without measuring
    monkeypatch.setattr(quant_auto, "measure", _no_measuring)
    again = load_model(ModelSpec(str(path), "auto", device="cpu"))
    assert again.quant == "bf16" and again.quant_choice == refused.quant_choice


def test_a_file_kept_exactly_is_its_own_choice_unmeasured(quantized_file, cache, monkeypatch):
    path, _ = quantized_file
    real = lowbit_folder.load
    monkeypatch.setattr(lowbit_folder, "load",
                        lambda *a: dataclasses.replace(real(*a), exact=True))
    monkeypatch.setattr(quant_auto, "measure", _no_measuring)
    lm = load_model(ModelSpec(str(path), "auto", device="cpu", requantize=True))
    assert lm.quant == "int4" and lm.quant_choice is None and "kept as stored" in lm.quant_reason


def _no_measuring(*_args, **_kwargs):
    raise AssertionError("measured")


def test_bitsandbytes_choices_and_a_damaged_folder_get_one_line(quantized_file, cache):
    path, _ = quantized_file
    with pytest.raises(ModelLoadError, match="keeps its own low-bit weights") as err:
        load_model(ModelSpec(str(path), "nf4", device="cpu"))
    assert "\n" not in str(err.value)
    manifest = resolve_folder(ModelSpec(str(path)))[0] / lowbit_folder.MANIFEST
    kept = manifest.read_text()
    manifest.write_text(json.dumps({"format": 99}))
    try:
        with pytest.raises(ModelLoadError, match="converted by another version"):
            load_model(ModelSpec(str(path), "auto", device="cpu"))
    finally:
        manifest.write_text(kept)


@pytest.mark.parametrize("wide_rows", [0, 2])  # every step on the kernels / wide ones bf16
def test_greedy_while_drafting_equals_plain_on_the_kept_bits(quantized_file, cache, wide_rows):
    from engine import neartie
    from engine.chat_template import conversation, encode
    from engine.config import SamplingParams
    from engine.drafters.payoff import FixedChain
    from engine.generate import run
    from engine.quant import set_wide_rows

    path, _ = quantized_file
    lm = load_model(ModelSpec(str(path), "int4", device="cpu"))
    set_wide_rows(lm.model, wide_rows)
    assert any(isinstance(m, LowBitLinear) for m in lm.model.modules())
    ids = encode(lm.tokenizer, conversation("Repeat: red green blue red green blue red"))
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    plain = run(lm, ids, params)[1]
    _text, drafted, stats = run(lm, ids, params, FixedChain(3))
    assert sum(stats.drafted) > 0
    # bf16 activations: a batched step may flip a near-tie, nothing wider (as in test_quant)
    divergence = neartie.measure(lm, ids, plain, drafted)
    assert divergence is None or divergence.near_tie, divergence
