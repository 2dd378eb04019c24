"""Weight-only int4 / int8 (engine/weights/quant.py): every family's linear layers, the LM head
included, run through PyTorch's kernels; logits stay close to fp32's; greedy replies with
every drafter equal plain decoding with the same quantized weights; auto's pure choices."""

from __future__ import annotations

import copy
import dataclasses
import gc
from pathlib import Path

import pytest
import torch

from engine.config import ModelSpec, SamplingParams
from engine.decode import neartie
from engine.decode.generate import run
from engine.errors import AcceleratorError
from engine.model.loading import fingerprint, load_model, wrap_model
from engine.weights import quant, quant_wide
from tests.conftest import make_tiny_model
from tests.engine import test_family_matrix as fm

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("llama-gqa", "qwen2-untied", "gemma2-alternating", "gpt2-absolute")
METHODS = ("lookup", "medusa", "kangaroo", "auto")


def quantized(lm, kind: str, wide_rows: int):
    model = quant.quantize_model(copy.deepcopy(lm.model), kind, wide_rows=wide_rows)
    return dataclasses.replace(wrap_model(model, lm.tokenizer, lm.spec, lm.model_id, kind),
                               eos_ids=())


@pytest.mark.parametrize("kind", quant.LOW_BIT)
@pytest.mark.parametrize("name", FAMILIES)
def test_every_linear_is_low_bit_and_logits_stay_close(name, kind, bundled_tokenizer):
    lm = fm.family_model(name, bundled_tokenizer)
    low = quantized(lm, kind, wide_rows=0)
    layers = quant.low_bit_layers(low.model)
    head = low.model.get_output_embeddings()
    assert isinstance(head, quant.LowBitLinear) and head.kind == quant.HEAD_KIND[kind]
    assert not [n for n, m in low.model.named_modules()
                if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]
    assert {m.kind for m in layers if m is not head} == {kind}
    # Each layer against the one it replaced, on the same inputs: 4-bit groups of 32
    # move a random layer's output by ~8% (errors compound through a random tiny model).
    original = dict(lm.model.named_modules())
    for name_, layer in low.model.named_modules():
        if isinstance(layer, quant.LowBitLinear):
            x = torch.randn(3, layer.in_features, device=fm.DEVICE)
            want = original[name_](x)
            err = ((layer(x.bfloat16()).float() - want).norm() / want.norm()).item()
            assert err < (0.12 if layer.kind == "int4" else 0.02), (name_, err)
    if kind == "int8w":
        ids = torch.tensor([fm.prompts()["fresh"]], device=fm.DEVICE)
        with torch.inference_mode():
            want = lm.model(input_ids=ids).logits
            got = low.model(input_ids=ids).logits
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("wide_rows", (0, 2))
@pytest.mark.parametrize("kind", quant.LOW_BIT)
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_with_every_drafter_equals_plain_on_the_same_weights(name, kind, wide_rows,
                                                                   bundled_tokenizer):
    """wide_rows 0: every step through the low-bit kernel; 2: steps of 2+ tokens through
    the bf16 copies (the path verification takes on a CPU)."""
    lm = quantized(fm.family_model(name, bundled_tokenizer), kind, wide_rows)
    for method in METHODS:
        try:
            drafter = fm.make_drafter(lm, method)
        except AcceleratorError as exc:
            assert "not supported for this architecture" in str(exc)
            continue
        for key, prompt in fm.prompts().items():
            params = SamplingParams(max_new_tokens=fm.CONTEXT - len(prompt))
            plain = run(lm, prompt, params)[1]
            drafted = run(lm, prompt, params, drafter)[1]
            # bf16 activations: a batched step may flip a near-tie, nothing wider
            divergence = neartie.measure(lm, prompt, plain, drafted)
            assert divergence is None or divergence.near_tie, (method, key, divergence)


def test_drafters_score_with_the_low_bit_head_itself(bundled_tokenizer):
    """No drafter keeps dense rows of a low-bit LM head (a full-precision copy of it):
    Medusa's heads and Kangaroo's adapter are scored by the head module, in its bits."""
    lm = quantized(fm.family_model(FAMILIES[0], bundled_tokenizer), "int4", wide_rows=0)
    head = lm.model.get_output_embeddings()
    medusa, kangaroo = fm.make_drafter(lm, "medusa"), fm.make_drafter(lm, "kangaroo")
    assert medusa._head is head and medusa._projection is None
    assert kangaroo.head is None
    states = torch.randn(3, head.in_features)
    torch.testing.assert_close(kangaroo.guesses(states)[0], head(states).float())


def test_tied_embeddings_read_the_heads_codes(bundled_tokenizer):
    """A tied table whose head went to 8 bits is read from the head's codes: the same
    values the head multiplies by, and no bf16 table of its own. A family's own embedding
    module (Gemma's scaled one) gets the head's values as a table, once."""
    from tests.conftest import make_tiny_model

    lm = make_tiny_model("llama-mha", bundled_tokenizer)  # tied
    assert lm.model.get_output_embeddings().weight is lm.model.get_input_embeddings().weight
    low = quantized(lm, "int4", wide_rows=0)
    head, table = low.model.get_output_embeddings(), low.model.get_input_embeddings()
    assert isinstance(table, quant.CodedEmbedding) and head.kind == "int8w"
    ids = torch.tensor([0, 5, 77, 300])
    assert torch.equal(table(ids), head.dequantized()[ids])
    rows = head.out_features
    tensors = [*low.model.parameters(), *low.model.buffers()]
    assert not any(t.dim() == 2 and t.shape[0] == rows and t.is_floating_point() for t in tensors)
    gemma = quantized(fm.family_model("gemma2-alternating", bundled_tokenizer), "int4", 0)
    head = gemma.model.get_output_embeddings()
    assert torch.equal(gemma.model.get_input_embeddings().weight, head.dequantized())


def test_dequantized_weights_are_what_the_kernel_multiplies(bundled_tokenizer):
    lm = fm.family_model("qwen2-untied", bundled_tokenizer)
    for kind in quant.LOW_BIT:
        layer = quant.low_bit_layers(quantized(lm, kind, wide_rows=1).model)[0]
        x = torch.randn(3, layer.in_features, dtype=torch.bfloat16, device=fm.DEVICE)
        want = layer.low_bit(x).float()
        torch.testing.assert_close((x @ layer.wide.t()).float(), want, atol=0.05, rtol=0.02)
        torch.testing.assert_close(layer.dequantized().float(), layer.wide.float(),
                                   atol=0.02, rtol=0.02)


def test_a_quantized_model_keeps_its_fingerprint_when_given(bundled_tokenizer):
    lm = fm.family_model("llama-gqa", bundled_tokenizer)
    model = quant.quantize_model(copy.deepcopy(lm.model), "int8w", wide_rows=0)
    wrapped = wrap_model(model, lm.tokenizer, ModelSpec(), "x", "int8w", 0.0, lm.fingerprint)
    assert wrapped.fingerprint == lm.fingerprint == fingerprint(lm.model)
    assert wrapped.dtype == torch.bfloat16


def test_crossover_is_the_first_size_from_which_the_copies_always_win():
    low = {1: 1.0, 2: 1.6, 4: 2.8, 8: 5.0}
    assert quant_wide.crossover(low, {1: 2.0, 2: 2.0, 4: 2.1, 8: 2.2}) == 4
    assert quant_wide.crossover(low, {1: 9.0, 2: 9.0, 4: 9.0, 8: 9.0}) == 0
    assert quant_wide.crossover(low, {1: 0.5, 2: 2.0, 4: 2.0, 8: 2.0}) == 4  # 1 alone is not it


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's mappings")
@pytest.mark.parametrize("kind", quant.LOW_BIT)
def test_low_bit_weights_leave_the_full_precision_file_unmapped(kind, tmp_path, bundled_tokenizer):
    """Weights quantized from a memory-mapped bf16 file keep no view of it: a norm left
    mapping the file would keep all of its pages resident beside the codes."""
    folder = tmp_path / "bf16"
    make_tiny_model("llama-gqa", bundled_tokenizer).model.to(torch.bfloat16).save_pretrained(folder)
    bundled_tokenizer.save_pretrained(folder)
    lm = load_model(ModelSpec(source=str(folder), quant=kind, step="eager"))
    gc.collect()
    assert lm.quant == kind
    assert str(folder / "model.safetensors") not in Path("/proc/self/maps").read_text()
