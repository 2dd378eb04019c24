"""Kangaroo training and calibration: the pure pieces, one adapter trained per exit layer on
a tiny model (still exact), the whole pipeline, and the CLI with nothing trained."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from engine.config import SamplingParams
from engine.decode import timing
from engine.decode.chat_template import conversation, encode
from engine.decode.generate import run
from engine.drafters import kangaroo as kangaroo_mod
from engine.drafters.kangaroo import Adapter, KangarooDrafter, KangarooSettings
from engine.drafters.kangaroo_adapter import draft_head
from engine.drafters.registry import load_drafter
from tests.conftest import make_tiny_model
from trainer.features import Features, encode_conversations, hidden_states
from trainer.kangaroo import calibrate_exit as calibrate_mod
from trainer.kangaroo.calibrate_exit import (
    Costs,
    KangarooCalibration,
    calibrate,
    choose,
    ctar,
    estimates,
    expected_round,
    one_round,
)
from trainer.kangaroo.train_adapter import (
    KangarooTrainConfig,
    batch_loss,
    fit_adapter,
    make_batches,
)
from trainer.training_loop import TrainConfig
from trainer.vocab import draft_vocabulary

pytestmark = pytest.mark.usefixtures("one_thread")


def test_one_round_follows_the_drafting_rule():
    # match[t]: the draft predicting position t is right; conf[t]: its top-1 probability.
    match = [True, True, False, True, True, True, True]
    conf = [0.9, 0.9, 0.9, 0.9, 0.2, 0.9, 0.9]
    assert one_round(match, conf, 0, 0.0, 3) == (3, 2)  # [T T F]: 3 drafted, 2 accepted
    assert one_round(match, conf, 3, 0.5, 5) == (2, 2)  # stops after conf 0.2 <= eta
    assert one_round(match, conf, 5, 0.0, 4) == (2, 2)  # the reply ends
    assert one_round([False] * 3, [0.9] * 3, 0, 0.0, 3) == (3, 0)  # all drafted, none kept


def test_expected_tokens_per_round():
    # Every draft right, sure: a round from t drafts min(gamma, 4 - t) and keeps them all.
    sure = ([True] * 4, [0.9] * 4)
    assert expected_round([sure], 0.5, 2) == (7 / 4, 11 / 4)  # drafts 2 2 2 1, tokens +1
    # Unsure (0.3 <= eta 0.5): one draft per round, kept when right (half the time).
    half = ([True, False, True, False], [0.3] * 4)
    assert expected_round([half], 0.5, 8) == (1.0, 1.5)
    # Positions of all replies pool: the mean over 8 positions.
    assert expected_round([sure, half], 0.5, 2) == ((7 + 4) / 8, (11 + 6) / 8)
    assert ctar([sure, half], 2)[:2] == [6 / 8, round(3 / 6, 4)]


def test_the_cost_model_trades_drafts_for_tokens():
    costs = Costs(plain=10.0, draft={1: 1.0, 2: 2.0}, verify={1: (9.0, 1.0), 2: (6.0, 0.5)})
    assert costs.round_ms(1, 3) == 4 * 1.0 + 9.0 + 4 * 1.0
    traces = {1: [([True] * 8, [0.9] * 8)], 2: [([True, False] * 4, [0.9] * 8)]}
    config = KangarooCalibration(etas=(0.0, 0.95), gammas=(1, 4))
    table = estimates(traces, costs, config)
    best = choose(table, 0.0)
    assert (best["exit_layer"], best["gamma"]) == (1, 4)  # always right: draft long
    # A near tie goes to the setting with more tokens per round, whatever the timing noise.
    close = [{"exit_layer": 1, "eta": 0.0, "gamma": 2, "estimated_speedup": 1.30,
              "tokens_per_round": 1.6},
             {"exit_layer": 2, "eta": 0.2, "gamma": 4, "estimated_speedup": 1.28,
              "tokens_per_round": 1.9}]
    assert choose(close, 0.03)["exit_layer"] == 2
    assert choose(close, 0.0)["exit_layer"] == 1


def test_two_calibrations_on_the_same_data_and_costs_choose_alike(bundled_tokenizer,
                                                                  monkeypatch):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)  # 4 layers
    adapters = {e: Adapter.from_model(lm.model, e) for e in (1, 2, 3)}
    prompts = [encode(lm.tokenizer, conversation(f"Question {i}: rivers?")) for i in range(2)]
    config = KangarooCalibration(prompts=2, max_new_tokens=16)
    costs = Costs(plain=10.0, draft={1: 1.0, 2: 2.0, 3: 3.0},
                  verify={1: (8.0, 0.5), 2: (6.0, 0.4), 3: (3.0, 0.3)})
    first, second = (calibrate(lm, adapters, None, prompts, config, costs=costs)
                     for _ in range(2))
    assert first.settings == second.settings and first.speedup == second.speedup
    assert first.settings.source_layer == first.settings.exit_layer  # the copied layer
    # Injected timings: every timed piece (the layer stack, the head, an adapter step) lasts
    # one second, so the costs are what the cost model makes of the layers' shares.
    ticks = itertools.count()
    for module in (calibrate_mod, timing):  # its deadlines and the timed pieces: one clock
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=ticks.__next__))
    timed = calibrate(lm, adapters, None, prompts,
                      KangarooCalibration(prompts=2, max_new_tokens=16, repeats=2))
    assert timed.table["costs_ms"] == {
        "plain": 2000.0,  # the stack and the head over one node
        "draft": {e: e / 4 * 1000 + 1000 for e in (1, 2, 3)},  # shallow layers + adapter
        "verify": {e: ((4 - e) / 4 * 1000 + 1000, 0.0) for e in (1, 2, 3)}}  # deep + head


def _features(ids: list[list[int]], masks: list[list[bool]]) -> Features:
    flat = torch.tensor([t for seq in ids for t in seq])
    lengths = torch.tensor([0] + [len(seq) for seq in ids])
    return Features(flat, torch.tensor([m for mask in masks for m in mask]), lengths.cumsum(0), {})


def test_draft_vocabulary_keeps_the_most_emitted_tokens_and_eos():
    feats = _features([[7, 5, 5, 5, 6, 6, 9]], [[False, True, True, True, True, True, True]])
    assert draft_vocabulary(feats, 2, (1,), 20).tolist() == [1, 5]
    assert draft_vocabulary(feats, 3, (1,), 20).tolist() == [1, 5, 6]
    assert draft_vocabulary(feats, 0, (1,), 20) is None


def test_batches_put_the_loss_where_the_next_token_is_an_answer():
    feats = _features([[1, 2, 3, 4], [5, 6]], [[False, False, True, True], [False, True]])
    batches = make_batches(feats, max_len=16, batch_tokens=4)
    assert len(batches) == 2  # 2 x 4 padded tokens do not fit in 4
    short, long = batches
    assert short.index.tolist() == [[4, 5]] and short.loss.tolist() == [[True, False]]
    assert long.loss.tolist() == [[False, True, True, False]]
    assert long.pad.tolist() == [[1, 1, 1, 1]]


CONVS = [
    [
        {"role": "user", "content": f"Question {i}: tell me about {topic}."},
        {
            "role": "assistant",
            "content": f"Here is something about {topic}: it is {adj} and {adj2}.",
        },
    ]
    for i, (topic, adj, adj2) in enumerate(
        [
            ("rivers", "long", "wet"),
            ("cats", "soft", "quiet"),
            ("stars", "far", "bright"),
            ("bread", "warm", "fresh"),
            ("trains", "fast", "loud"),
            ("snow", "cold", "white"),
        ]
        * 4
    )
]


def test_each_trained_exit_layer_lowers_the_loss_and_stays_exact(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    final = lm.model.config.num_hidden_layers
    ids, masks = encode_conversations(lm, CONVS)
    feats = hidden_states(lm, ids, [1, 2, 3, final], masks).load()
    vocab = draft_vocabulary(feats, 256, lm.eos_ids, lm.model.config.vocab_size)
    head = draft_head(lm.model, vocab).float()
    config = KangarooTrainConfig(batch_tokens=256, eval_positions=512)
    prompt = encode(lm.tokenizer, conversation("Question 99: tell me about rivers."))
    params = SamplingParams(max_new_tokens=32)
    plain = run(lm, prompt, params)[1]
    for exit_layer in (1, 2, 3):
        adapter = Adapter.from_model(lm.model)
        batch = make_batches(feats, 1024, 4096)[0]
        with torch.no_grad():
            before = float(batch_loss(lm.model, adapter, head, feats, exit_layer, batch))
        fit_adapter(
            lm,
            adapter,
            head,
            vocab,
            (feats, feats),
            exit_layer,
            config,
            TrainConfig(lr=3e-3, epochs=10, report_every=100),
        )
        with torch.no_grad():
            after = float(batch_loss(lm.model, adapter, head, feats, exit_layer, batch))
        # At l = L - 1 the copy of the last layer is the model itself: nothing to lower.
        assert after < before - (0.05 if exit_layer < 3 else -0.01), exit_layer
        d = KangarooDrafter(lm, adapter, KangarooSettings(exit_layer, 0.0, 4), vocab)
        assert run(lm, prompt, params, d)[1] == plain


def test_pipeline_trains_calibrates_and_saves_a_loadable_drafter(bundled_tokenizer,
                                                                 monkeypatch):
    from trainer.pipeline import TrainOptions, train_accelerator
    from trainer.seeds import DataBudget

    # Injected step costs (ms) instead of timed ones: a plain step 10, a draft step 0.5, a
    # verification 1 + 0.5 per node. Any drafting then beats plain decoding, so the branch
    # that keeps a schedule is the one taken, whatever the machine is doing.
    costs = Costs(10.0, {1: 0.5, 2: 0.5}, {1: (1.0, 0.5), 2: (1.0, 0.5)})
    monkeypatch.setattr(calibrate_mod, "time_costs", lambda *args, **kwargs: costs)
    lm = make_tiny_model("qwen2", bundled_tokenizer)
    options = TrainOptions(
        "kangaroo",
        max_minutes=1.0,
        calibration_seconds=5,
        heldout_fraction=0.15,
        data=DataBudget(max_conversations=40, batch_size=8, max_new_tokens=24, temperature=0.5),
        kangaroo=KangarooTrainConfig(
            exit_layers=(1, 2),
            epochs=2,
            draft_vocab=1000,
            calibration=KangarooCalibration(prompts=2, max_new_tokens=16, repeats=2),
        ),
    )
    result = train_accelerator(lm, options)
    m, s = result.metrics, result.settings
    assert set(m["agreement"]) == {"1", "2"} and m["pays"] is True
    assert s["draft_vocab_size"] <= 1000 and s["exit_layer"] in (1, 2) and s["gamma"] >= 1
    # The estimate is the cost model's, recomputed here from the chosen row's figures.
    chosen = (s["exit_layer"], s["gamma"], s["eta"])
    row = next(e for e in m["calibration"]["estimates"]
               if (e["exit_layer"], e["gamma"], e["eta"]) == chosen)
    drafts = row["drafts_per_round"]
    assert m["mean_accepted"] == row["tokens_per_round"]
    assert m["speedup"] == pytest.approx(
        m["mean_accepted"] * 10.0 / ((drafts + 1) * 0.5 + 1.0 + 0.5 * (drafts + 1)), rel=1e-3)
    assert len(m["ctar"]) == 6 and all(0 <= c <= 1 for c in m["ctar"])
    # the loaded adapter re-times its round here: pinned as cheap, so that it drafts
    monkeypatch.setattr(kangaroo_mod, "round_ratio", lambda lm, drafter: 0.5)
    drafter = load_drafter(lm, "kangaroo")  # the schedule calibration kept
    ids = encode(lm.tokenizer, conversation("Say something."))
    params = SamplingParams(max_new_tokens=24)
    _text, got, stats = run(lm, ids, params, drafter)
    assert got == run(lm, ids, params)[1] and sum(stats.drafted) > 0


@pytest.mark.slow
def test_chat_with_no_kangaroo_trained_says_how_to_train(capsys):
    from app.cli import main

    code = main(["chat", "--prompt", "hi", "--accel", "kangaroo", "--quant", "fp32"])
    err = capsys.readouterr().err
    assert code == 2
    assert "no kangaroo accelerator is trained for this model" in err
    assert "python launcher.py train --method kangaroo" in err
    assert "Traceback" not in err


def test_train_summary_says_plainly_whether_it_pays():
    from trainer.kangaroo.train_adapter import summary_lines

    settings = {"exit_layer": 2, "eta": 0.2, "gamma": 4, "draft_vocab_size": 5000}
    metrics = {"agreement": {"1": 0.25, "2": 0.3}, "vocab_coverage": 0.9, "pays": True,
               "speedup": 1.12, "mean_accepted": 1.4, "ctar": [0.3, 0.1, 0, 0, 0, 0]}
    text = "\n".join(summary_lines(metrics, settings))
    assert "l=2 30.0%" in text and "estimated 1.12x plain decoding" in text
    text = "\n".join(summary_lines({**metrics, "pays": False, "speedup": 0.93}, settings))
    assert "does not pay on this machine" in text and "0.93x" in text
    assert "never slower" in text
