"""A quantized GGUF file runs on its own blocks (`--quant gguf`, and `auto`'s default for a
GGUF file): every layer, the token table and the LM head keep the file's bytes, read as the
same values transformers' own conversion gives, with the same fingerprint; nothing is
expanded; settings and tokenizer are read from the file once."""

from __future__ import annotations

import pytest
import torch

from bench.gguf_writer import tokenizer_fields, write_gguf
from engine.config import ModelSpec, SamplingParams
from engine.decode.chat_template import conversation, encode
from engine.errors import ModelLoadError
from engine.model.loading import load_model
from engine.weights import gguf as qd_gguf
from engine.weights import gguf_model, kernels
from engine.weights.gguf_blocks import BlockEmbedding, BlockLinear
from tests.engine.weights.test_block_kernels import random_rows

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"kernels not built here: {kernels.problem}")

# the GGML type of each kind of tensor (K-quants as random blocks, the rest quantized by
# gguf from the model's weights): what Q4_K_M / Q5_K_M / Q6_K / Q8_0 files mix
TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q8_0",
         "ffn_gate": "Q4_0", "ffn_up": "Q5_1", "ffn_down": "Q5_0", "output": "Q6_K",
         "token_embd": "Q8_0"}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
PROMPT = "Repeat: red green blue red green blue red"


def tiny(family: str, tied: bool):
    """A random 2-layer model of `family` over the bundled vocabulary, wide enough for
    256-value K-quant blocks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=49152, hidden_size=256,
                                  intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, tie_word_embeddings=tied,
                                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def write_mixed(path, model, arch: str):
    """`model` as a GGUF file whose matrices are stored as TYPES says (layer 1's ffn_down as
    Q4_1)."""
    import gguf
    from gguf import GGMLQuantizationType, quants

    real_add = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, *args, **kwargs):
        kind = "Q4_1" if name == "blk.1.ffn_down.weight" else TYPES.get(name.split(".")[-2])
        if kind is None or tensor.ndim != 2:
            return real_add(self, name, tensor, *args, **kwargs)
        qtype = GGMLQuantizationType[kind]
        seed = sum(map(ord, name))
        data = (random_rows(kind, *tensor.shape, seed=seed, scale=2e-5 if kind == "Q6_K"
                            else 2e-4) if kind in K_QUANTS else quants.quantize(tensor, qtype))
        return real_add(self, name, data, raw_dtype=qtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
        write_gguf(path, model, tokenizer_fields(), arch=arch)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(qd_gguf, "cache_dir", lambda: root)
        patch.setattr(gguf_model, "cache_dir", lambda: root)
        yield root


@pytest.fixture(scope="module", params=[("llama", False), ("qwen2", True)],
            ids=["llama-untied", "qwen2-tied"])
def files(request, tmp_path_factory, cache):
    """(the file, the model run on its blocks, the same file converted by transformers)."""
    family, tied = request.param
    path = write_mixed(tmp_path_factory.mktemp(family) / f"tiny-{family}.gguf",
                       tiny(family, tied), family)
    messages = []
    stored = load_model(ModelSpec(str(path), "auto", device="cpu"), messages.append)
    assert any("first time only" in m for m in messages)
    converted = load_model(ModelSpec(str(path), "fp32", device="cpu"))
    return path, stored, converted


def test_every_matrix_keeps_the_files_blocks_and_reads_as_transformers_does(files):
    path, stored, converted = files
    assert stored.quant == "gguf" and "as stored" in stored.quant_reason
    assert "Q4_K for 2 layers" in stored.quant_reason
    model, reference = stored.model, converted.model.state_dict()
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, BlockLinear)}
    linears = [n for n, m in converted.model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert set(linears) <= set(blocks)  # every matrix, the LM head included
    for name, layer in blocks.items():
        assert layer.kind in (*TYPES.values(), "Q4_1"), name
        values = layer.rows(torch.arange(layer.out_features))
        # bit for bit (q/k rows in transformers' order, the head, the token table)
        key = f"{name.removesuffix('.table')}.weight"  # an untied table is the embedding's
        assert torch.equal(values, reference[key]), name
    assert isinstance(model.get_input_embeddings(), BlockEmbedding)
    tied = converted.model.config.tie_word_embeddings
    assert (model.get_input_embeddings().source is model.get_output_embeddings()) == tied
    assert stored.fingerprint == converted.fingerprint  # accelerators attach to either
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "rope_parameters", "max_position_embeddings", "vocab_size", "head_dim",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type"):
        assert getattr(model.config, key, None) == getattr(converted.model.config, key, None)
    ids = encode(stored.tokenizer, conversation(PROMPT))
    assert ids == encode(converted.tokenizer, conversation(PROMPT))
    assert stored.eos_ids == converted.eos_ids


def test_nothing_is_expanded(files):
    """No float copy of any matrix: every large tensor the model holds is the file's bytes."""
    _, stored, _ = files
    tensors = [*stored.model.parameters(), *stored.model.buffers()]
    floats = [t for t in tensors if t.is_floating_point()]
    assert max(t.numel() for t in floats) <= 2 * 512  # norms and biases
    packed = sum(t.numel() for t in tensors if t.dtype == torch.uint8)
    assert packed <= 1.01 * qd_gguf.inspect(files[0]).file_bytes


def test_replies_are_the_converted_models_and_drafting_keeps_them(files):
    from engine.decode import neartie
    from engine.decode.generate import run
    from engine.drafters.payoff import FixedChain

    _, stored, converted = files
    ids = encode(stored.tokenizer, conversation(PROMPT))
    with torch.inference_mode():
        got = stored.target.forward(stored.target.new_cache(), ids, 0).logits.float()
        want = converted.target.forward(converted.target.new_cache(), ids, 0).logits.float()
    # int8 activations and bf16 between layers: close to the fp32 expansion, not equal
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    plain = run(stored, ids, params)[1]
    _text, drafted, stats = run(stored, ids, params, FixedChain(3))
    assert sum(stats.drafted) > 0
    divergence = neartie.measure(stored, ids, plain, drafted)
    assert divergence is None or divergence.near_tie, divergence


def test_a_second_start_reads_only_the_blocks(files):
    path, stored, _ = files
    messages = []
    again = load_model(ModelSpec(str(path), "gguf", device="cpu"), messages.append)
    assert not any("first time only" in m for m in messages)
    assert again.fingerprint == stored.fingerprint


def test_other_sources_and_files_get_one_line(files, tmp_path, cache):
    from tests.engine.weights.gguf.test_gguf import tiny_llama

    path = files[0]
    with pytest.raises(ModelLoadError, match="is not a GGUF file") as err:
        load_model(ModelSpec(str(path.parent), "gguf", device="cpu"))
    assert "\n" not in str(err.value)
    odd = write_gguf(tmp_path / "odd.gguf", tiny_llama(), tokenizer_fields(), odd_type=True)
    with pytest.raises(ModelLoadError, match="no block kernel for its .*Q8_1") as err:
        load_model(ModelSpec(str(odd), "gguf", device="cpu"))
    assert "cannot run on its own blocks here" in str(err.value) and "\n" not in str(err.value)
