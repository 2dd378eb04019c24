"""Kangaroo on every decoder-only family the other drafters run on: the adapter (a copy of
one of the model's own decoder layers) trains briefly, is saved and loaded, and greedy
decoding with it is identical to plain decoding. Tiny random models built here."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import ModelSpec, SamplingParams
from engine.decode.generate import run
from engine.drafters.accelerators import save_checkpoint
from engine.drafters.registry import load_source
from engine.model.loading import wrap_model
from trainer.kangaroo.calibrate_exit import KangarooCalibration
from trainer.kangaroo.train_adapter import KangarooTrainConfig, train
from trainer.pipeline import TrainOptions
from trainer.training_loop import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0)
FAMILIES = {
    "llama": {},
    "qwen2": {"tie_word_embeddings": False},
    "mistral": {"sliding_window": 8},
    "qwen3": {"head_dim": 16},
    # alternating sliding / full layers, attention and final logit soft-capping
    "gemma2": {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "phi3": {},  # fused qkv and gate-up projections
    "olmo2": {},  # norms after attention and the FFN, q/k norms over all heads
    "smollm3": {"no_rope_layer_interval": 2},  # every other layer without rotary
}


def family_model(family: str, tokenizer):
    if family == "gpt2":  # learned absolute positions
        config = AutoConfig.for_model("gpt2", n_embd=64, n_inner=128, n_layer=3, n_head=4,
                                      n_positions=256)
    else:
        config = AutoConfig.for_model(family, **{**LLAMA_LIKE, **FAMILIES[family]})
    config.vocab_size, config.initializer_range = len(tokenizer), 0.2
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return wrap_model(model, tokenizer, ModelSpec(source=f"tiny-{family}"), f"tiny-{family}",
                      "fp32")


def conversations(n: int, seed: int) -> list[list[dict]]:
    gen = torch.Generator().manual_seed(seed)
    return [[{"role": "user", "content": f"q{i}"},
             {"role": "assistant", "content": " ".join(
                 str(int(t)) for t in torch.randint(0, 9, (12,), generator=gen))}]
            for i in range(n)]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))  # feature shards


@pytest.mark.parametrize("family", [*sorted(FAMILIES), "gpt2"])
def test_kangaroo_trains_and_decodes_exactly(family, bundled_tokenizer):
    lm = family_model(family, bundled_tokenizer)
    options = TrainOptions(
        "kangaroo", max_minutes=1.0, train=TrainConfig(epochs=1),
        kangaroo=KangarooTrainConfig(
            exit_layers=(1, 2), epochs=2, draft_vocab=500, batch_tokens=512,
            calibration=KangarooCalibration(prompts=1, max_new_tokens=8, repeats=1,
                                            verify_sizes=(1, 2), seconds=5)))
    tensors, settings, metrics = train(lm, conversations(6, 0), conversations(2, 1), options)
    assert set(metrics["agreement"]) == {"1", "2"}
    save_checkpoint(lm, "kangaroo", tensors, settings, metrics)
    drafter = load_source(lm, "kangaroo").with_schedule(0.0, 3)  # draft whatever it chose
    prompt = list(range(20, 50))
    params = SamplingParams(max_new_tokens=30)
    _t, got, stats = run(lm, prompt, params, drafter)
    assert got == run(lm, prompt, params)[1]
    assert sum(stats.drafted) > 0
