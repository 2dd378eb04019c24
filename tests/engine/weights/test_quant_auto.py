"""--quant auto on a CPU: admitted by answers, picked by ratios of interleaved timings (the
same pick idle and under load), remembered, and safe on a model with a short window."""

from __future__ import annotations

import random

import pytest
import torch

from engine.config import ModelSpec, SamplingParams
from engine.decode.generate import run
from engine.model.loading import load_model, wrap_model
from engine.weights import quant, quant_answers, quant_auto
from tests.conftest import make_tiny_model

# Plain-step seconds of the bundled model's choices measured on a 2-core CPU (lean step).
IDLE = {"fp32": 0.060, "bf16": 0.031, "int8w": 0.021, "int4": 0.0175}


def rounds_under(load: list[float], noise: float, base: dict, seed: int) -> list[dict]:
    """One round per load factor: every candidate slowed alike by the machine's load, each
    reading jittered by `noise`."""
    rng = random.Random(seed)
    return [{q: s * factor * rng.uniform(1 - noise, 1 + noise) for q, s in base.items()}
            for factor in load]


def test_admitted_answer_as_well_as_bf16():
    right = {"fp32": 24, "bf16": 26, "int8w": 25, "int4": 22}
    ppl = {"fp32": 10.0, "bf16": 10.0, "int8w": 10.1, "int4": 10.1}
    assert quant_auto.admitted(right, ppl) == ["fp32", "bf16", "int8w"]  # int4 4 fewer right
    assert quant_auto.admitted(right, {**ppl, "int8w": 10.3}) == ["fp32", "bf16"]  # ppl +3%
    assert quant_auto.admitted({**right, "int4": 25}, ppl) == ["fp32", "bf16", "int8w", "int4"]


def test_the_same_pick_idle_and_under_load():
    order = list(IDLE)
    idle = rounds_under([1.0] * 5, 0.03, IDLE, seed=0)
    # a CPU-bound process beside it: every reading 1.5-3x slower, varying round to round
    loaded = rounds_under([random.Random(1).uniform(1.5, 3.0) for _ in range(5)], 0.05, IDLE, 1)
    assert quant_auto.pick(order, idle)[0] == "int4"
    assert quant_auto.pick(order, loaded)[0] == "int4"
    # a clock reading alone would flip: the loaded fp32 beat the idle int4 in raw seconds
    assert min(r["fp32"] for r in loaded) > 0 and quant_auto.pick(order[:2], loaded)[0] == "bf16"


def test_a_smaller_choice_must_be_clearly_faster():
    near = {"fp32": 0.060, "bf16": 0.031, "int8w": 0.029, "int4": 0.0262}
    best, clear, said = quant_auto.pick(list(near), rounds_under([1.0] * 5, 0.0, near, 0))
    # int8w is 1.07x bf16: not enough; int4 is 1.18x bf16: faster
    assert best == "int4" and clear
    assert said[1].startswith("int8w 1.07x bf16: not enough faster")
    tie = {"fp32": 0.031, "bf16": 0.030}
    best, _clear, _said = quant_auto.pick(list(tie), rounds_under([1.0] * 5, 0.0, tie, 0))
    assert best == "fp32"  # 1.03x is no reason to leave the larger weights


def test_rounds_that_straddle_the_bar_are_not_clear():
    straddle = [{"bf16": 0.030, "int4": 0.030 / r} for r in (1.0, 1.3, 1.05, 1.2)]
    ratio, clear = quant_auto.compare(straddle, "bf16", "int4")
    assert ratio > quant_auto.FASTER and not clear
    assert quant_auto.pick(["bf16", "int4"], straddle)[0] == "bf16"  # unsettled: the larger
    steady = [{"bf16": 0.030, "int4": 0.030 / r} for r in (1.7, 1.72, 1.69)]
    assert quant_auto.compare(steady, "bf16", "int4")[1]


def test_answers_are_checked_as_words():
    assert quant_answers.is_right("The answer is 4.", ["4"])
    assert not quant_answers.is_right("It is 14.", ["4"])
    assert quant_answers.is_right("Paris is the capital.", ["paris"])
    assert not quant_answers.is_right("L'Étoile, la Marseillaise", ["paris"])


def test_the_question_set_is_held_out():
    asked = quant_answers.questions()
    assert len(asked) >= 50 and all(q["answers"] for q in asked)
    seen = " ".join(open(quant_auto.ASSETS / name, encoding="utf-8").read().lower()
                    for name in ("seed_prompts.jsonl", "bench_prompts.jsonl"))
    assert not [q["prompt"] for q in asked if q["prompt"].lower() in seen]


def test_auto_measures_once_and_remembers(bundled_tokenizer, monkeypatch, tmp_path):
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(quant_auto, "MAX_ROUNDS", 3)
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    model = lm.model.to(torch.bfloat16)
    said = []
    choice = quant_auto.measure(model, lm.tokenizer,
                                lambda m, q: wrap_model(m, lm.tokenizer, lm.spec, "x", q),
                                lm.context_len, lm.eos_ids, said.append,
                                budget_s=3600)  # no timing here: every question fits
    assert set(choice.records) == {"fp32", "bf16", "int8w", "int4"}
    assert choice.questions == len(quant_answers.questions())
    assert any("checking int4's answers" in m for m in said)
    assert all("first time only" in m for m in said)
    assert choice.records["bf16"]["same"] == choice.questions
    assert choice.quant in choice.records and choice.quant in choice.reason
    timed = sum(r["admitted"] for r in choice.records.values())
    assert choice.line().count("ms/step") == timed  # every admitted choice was timed
    assert choice.line().startswith(f"auto picked {choice.quant}: fp32 ")
    key = quant_auto.machine_key(lm.fingerprint)
    assert quant_auto.remembered(key) is None
    quant_auto.remember(key, choice)
    assert quant_auto.remembered(key) == choice
    assert not any(isinstance(m, quant.LowBitLinear) for m in model.modules())


@pytest.fixture
def short_window(tmp_path, bundled_tokenizer):
    """A GPT-2-style model whose learned positions stop at 64, saved as a user's folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(bundled_tokenizer), n_positions=64, n_embd=64,
                        n_layer=2, n_head=4, eos_token_id=bundled_tokenizer.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "short")
    bundled_tokenizer.save_pretrained(tmp_path / "short")
    return tmp_path / "short"


def test_auto_on_a_64_position_window_loads_chooses_and_decodes(short_window, monkeypatch,
                                                                 tmp_path):
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(quant_auto, "MAX_ROUNDS", 3)
    lm = load_model(ModelSpec(source=str(short_window), quant="auto"))
    choice = lm.quant_choice
    assert choice.records, choice.reason  # measured, not fallen back
    assert choice.questions < len(quant_answers.questions())  # only what fits in 64 positions
    assert lm.quant == choice.quant
    prompt = lm.tokenizer("Hello there")["input_ids"]
    text, ids, _stats = run(lm, prompt, SamplingParams(max_new_tokens=8))
    assert 0 < len(ids) <= 8


def test_a_failed_measurement_keeps_bf16_in_one_line(tiny_folder_auto, monkeypatch):
    def broken(*_args, **_kw):
        raise RuntimeError("kernel missing\nsecond line")

    monkeypatch.setattr(quant_auto, "measure", broken)
    lm = load_model(ModelSpec(source=str(tiny_folder_auto), quant="auto"))
    assert lm.quant == "bf16"
    assert lm.quant_reason == "bf16: could not measure the other choices (kernel missing)"


@pytest.fixture
def tiny_folder_auto(tmp_path, bundled_tokenizer, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    lm.model.save_pretrained(tmp_path / "tiny")
    bundled_tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_requantize_measures_again(tiny_folder_auto, monkeypatch):
    monkeypatch.setattr(quant_auto, "MAX_ROUNDS", 3)
    calls = []
    measure = quant_auto.measure
    monkeypatch.setattr(quant_auto, "measure", lambda *a, **k: calls.append(1) or measure(*a, **k))
    first = load_model(ModelSpec(source=str(tiny_folder_auto), quant="auto"))
    load_model(ModelSpec(source=str(tiny_folder_auto), quant="auto"))
    assert len(calls) == 1  # remembered
    again = load_model(ModelSpec(source=str(tiny_folder_auto), quant="auto", requantize=True))
    assert len(calls) == 2
    assert again.quant_choice.records.keys() == first.quant_choice.records.keys()


def test_a_batch_answers_what_the_budget_leaves_room_for():
    """A batch costs its reference's reply steps (shared by its rows) and a price per
    question: a larger model answers fewer questions, one whose reply alone overruns the
    budget none."""
    assert quant_auto.plan_batch(36, 2.0, 0.5, 52) == quant_auto.MAX_BATCH
    assert quant_auto.plan_batch(36, 12.0, 3.0, 52) == 8
    assert quant_auto.plan_batch(36, 12.0, 3.0, 5) == 5
    assert quant_auto.plan_batch(36, 40.0, 0.1, 52) == 0
    assert quant_auto.plan_batch(-1, 0.0, 0.1, 52) == 0


def test_a_model_too_slow_for_the_budget_keeps_the_reference_without_answering(
        bundled_tokenizer, monkeypatch):
    """As a 7B-class model on a 2-core CPU: one reply's steps cost more than the budget, so
    no question is asked, the reference stays, and the reason and the progress say so."""
    monkeypatch.setattr(quant_auto, "_probe", lambda *_a: (90.0, 4.0))
    monkeypatch.setattr(quant_answers, "answer", _no_answers)
    monkeypatch.setattr(quant_auto, "_perplexities", lambda *_a: {})  # too slow as well
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    said = []
    choice = quant_auto.measure(lm.model.to(torch.bfloat16), lm.tokenizer,
                                lambda m, q: wrap_model(m, lm.tokenizer, lm.spec, "x", q),
                                lm.context_len, lm.eos_ids, said.append)
    assert choice.quant == "bf16" and choice.questions == 0
    assert "no question could be answered in 60 s here, nothing measured" in choice.reason
    assert [n for n, r in choice.records.items() if r["admitted"]] == ["bf16"]
    assert said and all("of at most ~60 s" in m for m in said)


def _no_answers(*_args):
    raise AssertionError("a question was answered")


def test_a_reply_stops_once_it_is_decided():
    assert quant_answers.settled_right("Paris, of course", ["paris"])
    assert not quant_answers.settled_right("It is 4", ["4"])  # could still become 42
    assert quant_answers.settled_right("It is 4.", ["4"])
    assert not quant_answers.settled_right("It is 14.", ["4"])


def test_a_candidate_that_follows_the_reference_is_not_asked_again(bundled_tokenizer,
                                                                   monkeypatch):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    asked = quant_answers.prompts_that_fit(lm.tokenizer, quant_answers.questions()[:6],
                                           lm.context_len)
    prompts, answers = [p for p, _a in asked], [a for _p, a in asked]
    eos = set(lm.eos_ids)
    reference = quant_answers.replies(lm.model, lm.tokenizer, prompts, answers, eos)
    assert all(len(r) == quant_answers.REPLY_TOKENS or r[-1] in eos for r in reference)
    generated = []
    real = quant_answers.replies
    monkeypatch.setattr(quant_answers, "replies",
                        lambda m, t, p, *a: generated.append(len(p)) or real(m, t, p, *a))
    got, same = quant_answers.answer(lm.model, lm.tokenizer, prompts, answers, eos, reference)
    assert got == reference and all(same) and sum(generated) == 0
    # a candidate that departs answers anew where it does
    other = make_tiny_model("llama-gqa", bundled_tokenizer, seed=1)
    got, same = quant_answers.answer(other.model, lm.tokenizer, prompts, answers, eos,
                                     reference)
    assert sum(generated) == same.count(False) > 0
    assert got == real(other.model, lm.tokenizer, prompts, answers, eos)  # its own replies


def test_where_no_question_fits_perplexity_alone_admits(bundled_tokenizer, monkeypatch):
    """A model whose replies overrun the budget but whose held-out text fits: the choice
    goes by perplexity and speed, and says so."""
    monkeypatch.setattr(quant_auto, "_probe", lambda *_a: (90.0, 4.0))
    monkeypatch.setattr(quant_answers, "answer", _no_answers)
    monkeypatch.setattr(quant_auto, "MAX_ROUNDS", 2)
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    choice = quant_auto.measure(lm.model.to(torch.bfloat16), lm.tokenizer,
                                lambda m, q: wrap_model(m, lm.tokenizer, lm.spec, "x", q),
                                lm.context_len, lm.eos_ids)
    assert choice.questions == 0 and "perplexity alone measured" in choice.reason
    assert all(r["perplexity"] > 0 for r in choice.records.values())
    admitted = [n for n, r in choice.records.items() if r["admitted"]]
    assert admitted == quant_auto.admitted(dict.fromkeys(choice.records, 0),
                                           {n: r["perplexity"] for n, r in
                                            choice.records.items()})
    assert choice.line().count("ms/step") == len(admitted) > 1  # timed
