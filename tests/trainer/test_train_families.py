"""`train` on models outside the bundled model's envelope: a sliding window shorter than the
trainer's contexts, learned absolute positions with a short context, an architecture
Kangaroo cannot split, and a failure nobody foresaw (one line, never a traceback)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from app.cli import main
from engine.config import ModelSpec, SamplingParams
from engine.decode.tree import build_tree
from engine.drafters.medusa import MedusaDrafter, MedusaHeads, MedusaSettings
from engine.drafters.registry import load_source
from engine.errors import AcceleratorError
from engine.model.loading import wrap_model
from tests.conftest import assert_exact_while_drafting
from trainer.kangaroo.calibrate_exit import KangarooCalibration
from trainer.kangaroo.train_adapter import KangarooTrainConfig
from trainer.medusa.calibrate_tree import CalibrationConfig
from trainer.medusa.train_heads import MedusaTrainConfig
from trainer.pipeline import TrainOptions, train_accelerator
from trainer.seeds import DataBudget
from trainer.selfdistill import data_path
from trainer.training_loop import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

# Answers may take up to 128 tokens: more than a 128-position model has room for after its
# prompt, and far past a 16-token sliding window.
DATA = DataBudget(max_conversations=12, batch_size=6, max_new_tokens=128, temperature=0.5)


def tiny(family: str, tokenizer, **extra):
    """A 2-3 layer random model of `family` with the bundled tokenizer, fp32 on the CPU."""
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer),
                                  eos_token_id=tokenizer.eos_token_id, initializer_range=0.2,
                                  **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    name = f"tiny-{family}"
    return wrap_model(model, tokenizer, ModelSpec(source=name), name, "fp32")


def sliding_mistral(tokenizer, **extra):
    """Mistral whose 16-token window every prompt, answer and timing context exceeds."""
    return tiny("mistral", tokenizer, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                **{"max_position_embeddings": 512, **extra})


def short_gpt2(tokenizer):
    """GPT-2: learned absolute positions, 128 of them."""
    return tiny("gpt2", tokenizer, n_embd=64, n_layer=2, n_head=4, n_positions=128)


def medusa_options() -> TrainOptions:
    return TrainOptions(
        method="medusa", max_minutes=2.0, heldout_fraction=0.3, calibration_seconds=1.0,
        data=DATA,
        medusa=MedusaTrainConfig(negatives=64, batch_positions=32, eval_positions=64),
        train=TrainConfig(epochs=1),
        calibration=CalibrationConfig(nodes=6, positions=64, prompts=1, max_new_tokens=96),
    )


def kangaroo_options() -> TrainOptions:
    return TrainOptions(
        "kangaroo", max_minutes=1.0, heldout_fraction=0.3, data=DATA,
        kangaroo=KangarooTrainConfig(
            exit_layers=(1,), epochs=1, draft_vocab=1000,
            calibration=KangarooCalibration(prompts=1, max_new_tokens=96, repeats=2)),
    )


def greedy_stays_exact(lm, method: str) -> None:
    drafter = load_source(lm, method)
    assert_exact_while_drafting(lm, list(range(20, 60)), SamplingParams(max_new_tokens=40),
                                drafter)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))  # feature shards


def test_medusa_builds_on_a_sliding_window_shorter_than_its_contexts(bundled_tokenizer):
    lm = sliding_mistral(bundled_tokenizer)
    result = train_accelerator(lm, medusa_options())
    assert result.folder is not None
    greedy_stays_exact(lm, "medusa")


def test_medusa_builds_on_learned_positions_with_a_short_context(bundled_tokenizer):
    lm = short_gpt2(bundled_tokenizer)
    result = train_accelerator(lm, medusa_options())
    assert result.folder is not None and result.data["tokens"] > 0
    greedy_stays_exact(lm, "medusa")


def test_the_heads_are_timed_inside_a_short_context(bundled_tokenizer):
    """A drafted step is timed after a made-up prompt of up to 192 tokens: on a model whose
    window is shorter, that prompt is cut to fit (past it, learned positions raise)."""
    lm = short_gpt2(bundled_tokenizer)
    heads = MedusaHeads(64, MedusaSettings(num_heads=4))
    tree = build_tree([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], 4)
    drafter = MedusaDrafter(lm, heads, tree, [0.9, 0.8, 0.7, 0.6])
    assert math.isfinite(drafter.overhead())


def test_kangaroo_keeps_every_position_inside_a_short_context(bundled_tokenizer):
    lm = sliding_mistral(bundled_tokenizer, max_position_embeddings=96)
    seen = []

    def record(_module, args, kwargs):
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        seen.append(int(positions.max()))

    hook = lm.model.model.rotary_emb.register_forward_pre_hook(record, with_kwargs=True)
    try:
        result = train_accelerator(lm, kangaroo_options())
    finally:
        hook.remove()
    assert result.folder is not None
    assert max(seen) < lm.context_len  # RoPE raises nothing past the end: check, not crash
    greedy_stays_exact(lm, "kangaroo")


def test_kangaroo_refuses_an_architecture_it_cannot_split_before_making_data(bundled_tokenizer):
    lm = short_gpt2(bundled_tokenizer)
    del lm.model.transformer.wpe  # neither of the layouts Kangaroo can split
    with pytest.raises(AcceleratorError, match="not supported for this architecture"):
        train_accelerator(lm, kangaroo_options())
    assert not data_path(lm).exists()  # no data budget spent on a build that cannot finish


def test_an_unforeseen_training_failure_is_one_line(bundled_tokenizer, monkeypatch, capsys):
    import app.commands.train as train_command
    import trainer.pipeline

    def crash(*_args, **_kwargs):
        raise RuntimeError("something inside transformers\nwith a second line")

    monkeypatch.setattr(train_command, "load",
                        lambda _args, compiled="load": short_gpt2(bundled_tokenizer))
    monkeypatch.setattr(trainer.pipeline, "train_accelerator", crash)
    assert main(["train", "--method", "medusa", "--max-minutes", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: training failed: RuntimeError: something")


def test_an_unforeseen_failure_of_the_ui_training_job_is_one_line():
    from app.jobs import Job

    def crash():
        raise RuntimeError("\nthe current layer does not track past states\n  at layer 3")

    job = Job("train", "Medusa for tiny").start(crash)
    assert job.wait(10) and job.state == "failed"
    assert job.error.startswith("Training failed unexpectedly (error ")
    assert "RuntimeError" not in job.error and "\n" not in job.error  # the type: in the log
