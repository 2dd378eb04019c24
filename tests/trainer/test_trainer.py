"""Trainer pieces: features and their cache, the pure losses, the shared training loop, the
Medusa trainer and calibration's choice."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from engine.drafters.medusa import MedusaHeads, MedusaSettings
from tests.conftest import make_tiny_model
from trainer import features as features_mod
from trainer.features import Features, encode_conversations, hidden_states
from trainer.losses import (
    candidate_columns,
    head_weights,
    rank_hits,
    soft_cross_entropy,
    sparse_soft_cross_entropy,
)
from trainer.medusa import calibrate_tree as calibration
from trainer.medusa.train_heads import (
    MedusaTrainConfig,
    fit_heads,
    head_accuracies,
    head_inputs,
    positions,
    teacher_topk,
)
from trainer.training_loop import TrainConfig, lr_factor, train_module

CONVS = [
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two, three."},
    ],
]


@pytest.fixture
def lm(bundled_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))  # a private feature cache
    return make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=2)


# --- features ------------------------------------------------------------------------------


def test_the_mask_covers_exactly_the_models_answers(lm):
    ids, masks = encode_conversations(lm, CONVS)
    answers = lm.tokenizer.decode([t for t, m in zip(ids[1], masks[1], strict=True) if m])
    assert "Hello! How can I help?" in answers and "One, two, three." in answers
    assert "Count to three" not in answers and "Hi" not in answers.replace("Hello", "")
    assert "<|im_end|>" in answers  # the model must learn to end its turn too


def test_cached_states_equal_a_direct_forward(lm):
    ids, masks = encode_conversations(lm, CONVS)
    cache = hidden_states(lm, ids, [1, 2], masks)
    feats = cache.load()
    assert feats.conversations == 2 and feats.tokens == sum(map(len, ids))
    with torch.no_grad():
        for c, seq in enumerate(ids):
            out = lm.model(torch.tensor([seq]), output_hidden_states=True)
            a, b = int(feats.offsets[c]), int(feats.offsets[c + 1])
            for layer in (1, 2):  # 2 = the final normed state the LM head reads
                assert torch.allclose(
                    feats.states[layer][a:b], out.hidden_states[layer][0], atol=1e-4
                )
            assert feats.ids[a:b].tolist() == seq and feats.mask[a:b].tolist() == masks[c]


def test_the_cache_is_reused_and_a_torn_shard_is_recomputed(lm, monkeypatch):
    ids, masks = encode_conversations(lm, CONVS)
    first = hidden_states(lm, ids, [2], masks)
    writes = []
    real_write = features_mod._write_shard
    monkeypatch.setattr(features_mod, "_write_shard", lambda *a: writes.append(a) or real_write(*a))
    assert hidden_states(lm, ids, [2], masks).shards == first.shards and not writes
    shard = first.shards[0]
    shard.write_bytes(shard.read_bytes()[:100])  # a kill mid-write
    hidden_states(lm, ids, [2], masks)
    assert len(writes) == 1 and first.load().tokens == sum(map(len, ids))


def test_bad_layers_are_refused(lm):
    with pytest.raises(Exception, match="within 0..2"):
        hidden_states(lm, [[1, 2, 3]], [3])


# --- losses --------------------------------------------------------------------------------


def test_soft_cross_entropy_of_a_one_hot_teacher_is_cross_entropy():
    student = torch.randn(4, 10)
    target = torch.tensor([1, 5, 0, 9])
    teacher = torch.full((4, 10), -1e9).scatter(1, target.unsqueeze(1), 0.0)
    assert torch.allclose(
        soft_cross_entropy(student, teacher), torch.nn.functional.cross_entropy(student, target)
    )


def test_sparse_soft_cross_entropy_equals_the_dense_formula():
    student = torch.randn(4, 10)
    cols = torch.tensor([[1, 5], [0, 9], [3, 4], [2, 2]])
    t_logits = torch.randn(4, 2)
    dense_teacher = torch.zeros(4, 10).scatter_add(1, cols, t_logits.softmax(-1))
    dense = -(dense_teacher * student.log_softmax(-1)).sum(-1)
    assert torch.allclose(sparse_soft_cross_entropy(student, cols, t_logits), dense, atol=1e-6)


def test_a_one_hot_teacher_gives_cross_entropy_and_the_teacher_is_the_minimum():
    student = torch.randn(4, 10)
    target = torch.tensor([1, 5, 0, 9])
    hard = sparse_soft_cross_entropy(student, target.unsqueeze(1), torch.zeros(4, 1))
    assert torch.allclose(
        hard, torch.nn.functional.cross_entropy(student, target, reduction="none")
    )
    cols = torch.arange(10).expand(3, 10)
    teacher = torch.randn(3, 10)
    best = sparse_soft_cross_entropy(teacher, cols, teacher).mean()
    assert (
        best < sparse_soft_cross_entropy(teacher + 0.5 * torch.randn(3, 10), cols, teacher).mean()
    )


def test_head_weights_and_hits():
    assert head_weights(3) == pytest.approx([0.8, 0.64, 0.512])
    guesses = torch.tensor([[1, 2], [0, 1]])  # ranked ids per row
    assert rank_hits(guesses, torch.tensor([2, 0])).tolist() == [[False, True], [True, False]]


def test_candidate_columns_keep_every_teacher_token():
    top = torch.tensor([[5, 3], [3, 9]])
    cols = candidate_columns(top, 100, 10, torch.Generator().manual_seed(0))
    assert {3, 5, 9} <= set(cols.tolist()) and cols.tolist() == sorted(set(cols.tolist()))


# --- the shared loop -----------------------------------------------------------------------


def _regression():
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1)
    return torch.nn.Linear(8, 1), [(x[i : i + 32], y[i : i + 32]) for i in range(0, 256, 32)]


def _mse(module, batch):
    x, y = batch
    return ((module(x) - y) ** 2).mean(), {}


def test_the_loop_fits_and_reports(monkeypatch):
    module, batches = _regression()
    before = sum(_mse(module, b)[0].item() for b in batches)
    seen = []
    figures = train_module(
        module,
        lambda e: batches,
        _mse,
        TrainConfig(lr=0.05, epochs=20, report_every=8),
        seen.append,
    )
    after = sum(_mse(module, b)[0].item() for b in batches)
    assert after < 0.05 * before and figures["steps"] == 160 and figures["stopped"] == "done"
    assert seen and seen[-1].stage == "train" and seen[-1].done == 160


def test_cancel_keeps_the_best_weights_seen():
    module, batches = _regression()
    cancel = threading.Event()
    scores = iter([3.0, 1.0, 2.0, 5.0])
    snapshots = []

    def eval_fn(m):
        snapshots.append(m.weight.detach().clone())
        if len(snapshots) == 3:
            cancel.set()
        return next(scores)

    figures = train_module(
        module,
        lambda e: batches,
        _mse,
        TrainConfig(lr=0.05, epochs=10),
        cancel=cancel,
        eval_fn=eval_fn,
    )
    assert figures["stopped"] == "cancelled" and figures["best_eval_loss"] == 1.0
    assert torch.equal(module.weight, snapshots[1])  # evaluation 2 scored best


def test_held_out_figures_are_reported_as_training_proceeds():
    module, batches = _regression()
    seen = []
    evals = iter(range(100))

    def eval_fn(m):
        n = next(evals)
        return -n, {"head-1 top-1": n / 100}

    figures = train_module(module, lambda e: batches, _mse,
                           TrainConfig(lr=0.05, epochs=3, report_every=4), seen.append,
                           eval_fn=eval_fn)
    assert [row["head-1 top-1"] for row in figures["heldout_curve"]] == [0.0, 0.01, 0.02]
    assert [row["step"] for row in figures["heldout_curve"]] == [8, 16, 24]
    assert "held-out head-1 top-1 2.0%" in seen[-1].message
    assert "held-out" not in seen[0].message  # nothing evaluated before the first epoch ends
    # the figures reach the progress metrics (the Train tab's accuracy chart) once per
    # evaluation, at the step they were measured
    plotted = [(p.done, p.metrics["head-1 top-1"]) for p in seen if "head-1 top-1" in p.metrics]
    assert plotted == [(8, 0.0), (16, 0.01), (24, 0.02)]


def test_a_run_stopped_between_reports_still_reports_its_last_loss():
    module, batches = _regression()
    seen, cancel = [], threading.Event()

    def eval_fn(m):
        cancel.set()  # the first evaluation ends the run, before any regular report
        return 1.0, {"top-1": 0.5}

    train_module(module, lambda e: batches, _mse, TrainConfig(lr=0.05, epochs=5,
                 report_every=100), seen.append, cancel=cancel, eval_fn=eval_fn)
    assert seen and "loss" in seen[-1].metrics and seen[-1].metrics["top-1"] == 0.5


def test_the_time_budget_stops_the_loop():
    module, batches = _regression()
    figures = train_module(
        module, lambda e: batches, _mse, TrainConfig(epochs=1000, max_seconds=0.0)
    )
    assert figures["stopped"] == "time" and figures["steps"] == 0


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(warmup=0.1, min_lr_ratio=0.05)
    assert lr_factor(0.05, cfg) == pytest.approx(0.5)
    assert lr_factor(0.1, cfg) == pytest.approx(1.0)
    assert lr_factor(1.0, cfg) == pytest.approx(0.05)
    assert lr_factor(0.3, cfg) > lr_factor(0.6, cfg) > lr_factor(0.9, cfg)


# --- Medusa trainer ------------------------------------------------------------------------


def test_positions_use_states_that_predict_answer_text():
    # two conversations: tokens 0-4 and 5-7; answers at 2, 3, 4 and 7
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1], dtype=torch.bool)
    feats = Features(torch.zeros(8, dtype=torch.long), mask, torch.tensor([0, 5, 8]), {})
    pos, valid = positions(feats, 2)
    assert pos.tolist() == [1, 2, 3, 6]  # the state at t predicts token t + 1
    assert valid.tolist() == [[True, True], [True, True], [True, False], [True, False]]


def test_training_teaches_heads_the_models_continuations(lm):
    """On one repeated conversation, trained heads guess t + 2 far better than untrained ones."""
    convs = [
        [
            {"role": "user", "content": "Say it."},
            {"role": "assistant", "content": "alpha beta gamma delta epsilon zeta eta theta"},
        ]
    ] * 4
    ids, masks = encode_conversations(lm, convs)
    feats = hidden_states(lm, ids, [2], masks).load()
    teacher = teacher_topk(lm, feats.states[2], 4)
    pos, valid = positions(feats, 2)
    heads = MedusaHeads(64, MedusaSettings(2))
    before = head_accuracies(lm, heads, head_inputs(lm, feats, heads), teacher, pos, valid, 1)
    cfg = MedusaTrainConfig(num_heads=2, teacher_topk=4, negatives=64, batch_positions=32)
    fit_heads(lm, heads, (feats, teacher), (feats, teacher), cfg, TrainConfig(lr=0.05, epochs=60))
    after = head_accuracies(lm, heads, head_inputs(lm, feats, heads), teacher, pos, valid, 1)
    assert after[0][0] >= before[0][0] + 0.3


# --- calibration ---------------------------------------------------------------------------


def test_node_chances_count_whole_paths_on_held_out_positions(lm):
    """Each candidate's chance is the share of positions where every head on its path guessed
    the model's greedy token at its rank (counted, not multiplied), over the positions its
    depth fits: checked against a plain loop over the positions."""
    gen = torch.Generator().manual_seed(0)
    states = torch.randn(40, 64, generator=gen)
    heads = MedusaHeads(64, MedusaSettings(3, pending_rank=0))
    with torch.no_grad():
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=gen) * 0.2)
    lm_head = lm.model.get_output_embeddings()
    pos = torch.arange(30)
    with torch.no_grad():
        top = heads.logits(states[pos], None, lm_head.weight).topk(2, dim=-1).indices
    # the model's greedy token after each position (head j's target at t is the one after
    # t + j + 1): random, except where head 1's or 2's guesses are right
    greedy = torch.randint(0, 50, (40,), generator=gen)
    for t in range(0, 24, 3):
        greedy[t + 1] = top[t, 0, 0]  # head 1's top-1 right at every third position
        if t % 2 == 0:
            greedy[t + 2] = top[t, 1, 1]  # and head 2's second guess at every sixth
    teacher = SimpleNamespace(ids=greedy[:, None])
    valid = torch.ones(30, 3, dtype=torch.bool)
    valid[25:, 2] = False  # past the conversation's end for the third head
    inputs = SimpleNamespace(at=lambda p, device: (states[p], None))
    choices = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    got = calibration.node_chances(lm, heads, inputs, teacher, pos, valid, choices)
    for choice, chance in zip(choices, got, strict=True):
        fits = [t for t in range(30) if valid[t, len(choice) - 1]]
        hits = [t for t in fits if all(int(top[t, j, r]) == int(greedy[t + j + 1])
                                       for j, r in enumerate(choice))]
        assert chance == pytest.approx(len(hits) / len(fits), abs=1e-5), choice
    assert got[2] <= got[0] and got[4] <= got[2]  # a path is never likelier than its prefix
    assert got[0] > 0 and got[3] > 0  # the test compares hits, not only misses


@pytest.mark.parametrize("speedup", [1.3, 0.9])
def test_calibration_says_whether_the_heads_paid_when_measured(lm, monkeypatch, speedup):
    heads = MedusaHeads(64, MedusaSettings(2))
    found = [[[0], 0.6], [[0, 0], 0.3]]
    monkeypatch.setattr(calibration, "candidates", lambda *a: found)

    def fake_measure(_lm, drafters, _prompts, *_a):
        assert set(drafters) == {"plain", "medusa"}
        return {"plain": {"tokens_per_s": 10.0, "mean_accepted": 1.0, "speedup": 1.0},
                "medusa": {"tokens_per_s": 10 * speedup, "mean_accepted": 1.5,
                           "speedup": speedup}}

    monkeypatch.setattr(calibration, "measure", fake_measure)
    result = calibration.calibrate(lm, heads, [[0.5], [0.3]], None, None, None, None,
                                   [[1, 2, 3, 4]], calibration.CalibrationConfig())
    assert result.candidates == found
    assert result.pays_off == (speedup > 1)
    assert result.chosen == ("medusa" if speedup > 1 else "plain")
