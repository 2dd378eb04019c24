"""Model resolution, quantization and the user-facing errors of loading."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ModelSpec, SamplingParams
from engine.decode.generate import run
from engine.errors import ModelLoadError, QuickdraftError
from engine.model.loading import fingerprint, load_model
from tests.conftest import make_tiny_model


@pytest.fixture
def tiny_folder(tmp_path, bundled_tokenizer):
    """A tiny Llama saved as a safetensors folder, as a user's download would be."""
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    lm.model.save_pretrained(tmp_path / "tiny")
    bundled_tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_missing_local_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(ModelSpec(source=str(tmp_path / "nope")))


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(ModelSpec(source=str(tmp_path / "empty")))


def test_folder_with_pickle_weights_only(tiny_folder):
    for f in tiny_folder.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(ModelSpec(source=str(tiny_folder)))


def test_folder_with_no_causal_lm(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    folder = tmp_path / "t5"  # an encoder-decoder: not something this app can chat with
    T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                        d_kv=16, vocab_size=100)).save_pretrained(folder)
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_model(ModelSpec(source=str(folder), quant="fp32"))


def test_unknown_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="no-such-owner/no-such-model"):
        load_model(ModelSpec(source="no-such-owner/no-such-model"))


def test_invalid_quantization_name():
    with pytest.raises(QuickdraftError, match="unknown quantization"):
        ModelSpec(quant="int3")


def _greedy(model, lm, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate(): the reference for what a loaded model says."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                             max_new_tokens=n, do_sample=False, eos_token_id=list(lm.eos_ids),
                             pad_token_id=lm.eos_ids[0])
    return out[0, len(prompt):].tolist()


def test_local_folder_loads_and_generates(tiny_folder):
    lm = load_model(ModelSpec(source=str(tiny_folder), quant="fp32"))
    assert lm.quant == "fp32" and lm.model.dtype == torch.float32
    saved = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    for name, tensor in saved.state_dict().items():  # the folder's weights, not new ones
        assert torch.equal(lm.model.state_dict()[name], tensor), name
    _text, ids, stats = run(lm, [1, 2, 3], SamplingParams(max_new_tokens=5))
    assert stats.tokens == 5 and ids == _greedy(saved, lm, [1, 2, 3], 5)


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_bitsandbytes_quantization_on_cpu(tiny_folder, quant):
    lm = load_model(ModelSpec(source=str(tiny_folder), quant=quant))
    assert lm.quant == quant
    assert any("bitsandbytes" in type(m).__module__ for m in lm.model.modules())
    _text, ids, stats = run(lm, [1, 2, 3], SamplingParams(max_new_tokens=5))
    assert stats.tokens == 5 and ids == _greedy(lm.model, lm, [1, 2, 3], 5)


def test_fingerprint_ignores_dtype_but_not_weights(tiny_folder):
    fp32 = load_model(ModelSpec(source=str(tiny_folder), quant="fp32"))
    bf16 = load_model(ModelSpec(source=str(tiny_folder), quant="bf16"))
    assert fingerprint(fp32.model) == fingerprint(bf16.model)
    with torch.no_grad():
        fp32.model.get_output_embeddings().weight[0] += 1.0
    assert fingerprint(fp32.model) != fingerprint(bf16.model)


def test_chat_json_contract(capsys):
    from app.cli import main

    # the reply's content depends on the weights: pinned, not left to --quant auto
    assert main(["chat", "--prompt", "What is the capital of France?", "--json",
                 "--quant", "bf16", "--max-new-tokens", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "Paris" in out["text"]
    assert out["accel"] == "off" and out["token_ids"]
    assert set(out["stats"]) >= {"tokens", "steps", "tokens_per_s", "ttft_s", "mean_accepted"}
    assert out["stats"]["tokens"] == len(out["token_ids"])
    assert out["stats"]["quant"]["quant"] == "bf16" and out["stats"]["quant"]["asked"] == "bf16"


def test_cli_errors_are_one_line(capsys):
    from app.cli import main

    assert main(["chat", "--prompt", "  "]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "empty" in err and "Traceback" not in err
    assert main(["chat", "--prompt", "hi", "--model", "/no/such/folder"]) == 2
    assert "not found" in capsys.readouterr().err
