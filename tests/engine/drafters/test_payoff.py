"""Whether drafting pays in the dtype and on the device a model runs in: accelerators
calibrated elsewhere re-time themselves at load and decode plainly, saying so, where the
estimate does not beat plain decoding."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import timing
from engine.accelerators import Checkpoint, save_checkpoint
from engine.config import SamplingParams
from engine.drafters import kangaroo as kg
from engine.drafters import medusa as md
from engine.drafters.kangaroo import Adapter, KangarooDrafter, KangarooSettings
from engine.drafters.payoff import PAY_MARGIN, Payoff, machine, round_seconds, timed_elsewhere
from engine.drafters.registry import load_drafter
from engine.generate import run
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def lm(bundled_tokenizer):
    return make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=200)


def test_the_decision_weighs_tokens_per_step_against_step_costs():
    # This machine's figures (design notes): fp32 costs 37 ms for one token, 57 for eight;
    # bf16 24 and 27. A tree keeping 1.45 tokens per step loses in fp32 and wins in bf16.
    assert Payoff(1.45, 0.037, 0.057).speedup == pytest.approx(0.941, abs=1e-3)
    assert not Payoff(1.45, 0.037, 0.057).pays
    assert Payoff(1.45, 0.024, 0.027).pays
    assert not Payoff(PAY_MARGIN, 1.0, 1.0).pays  # breaking even by the margin is not enough


def test_an_accelerator_is_re_timed_where_calibration_did_not_time_it(lm):
    here = machine(lm)
    assert timed_elsewhere({"quant": "bf16", "machine": here}, lm)  # lm is fp32
    assert timed_elsewhere({"quant": "fp32", "device": "cuda", "machine": here}, lm)
    assert not timed_elsewhere({"quant": "fp32", "device": "cpu", "machine": here}, lm)
    assert not timed_elsewhere({"quant": "fp32", "machine": here}, lm)  # no device: its own
    # another machine, or none recorded (a shipped accelerator): re-timed
    assert timed_elsewhere({"quant": "fp32", "device": "cpu", "machine": "elsewhere"}, lm)
    assert timed_elsewhere({"quant": "fp32", "device": "cpu"}, lm)
    assert timed_elsewhere({}, lm)


def _kangaroo_checkpoint(lm, quant: str) -> Checkpoint:
    settings = KangarooSettings(2, 0.6, 4)
    drafter = KangarooDrafter(lm, Adapter(lm.model), settings)
    info = {"settings": {**settings.to_json(), "pays": True, "quant": quant, "device": "cpu",
                         "machine": machine(lm)}}
    return Checkpoint(Path("kangaroo"), drafter.tensors(), info,
                      {"pays": True, "speedup": 1.3, "mean_accepted": 1.25})


def _timers(monkeypatch, plain: float, round_: float) -> list:
    calls = []
    monkeypatch.setattr(kg, "plain_step_seconds", lambda lm: calls.append("plain") or plain)
    monkeypatch.setattr(kg, "round_seconds", lambda lm, d: calls.append(d.settings.gamma) or round_)
    return calls


def test_kangaroo_that_does_not_pay_here_decodes_plainly_and_says_so(lm, monkeypatch):
    calls = _timers(monkeypatch, plain=0.037, round_=0.060)  # 1.25 tokens: 0.77x
    drafter = KangarooDrafter.from_checkpoint(lm, _kangaroo_checkpoint(lm, "bf16"))
    assert sorted(calls, key=str) == [2, "plain"]  # rounds timed with ceil(1.25) drafts
    assert drafter.off and not drafter.pays
    assert drafter.retimed_speedup == pytest.approx(0.77, abs=0.01)
    assert "0.77x plain decoding in fp32" in drafter.notice
    _t, ids, stats = run(lm, [5, 6, 7], SamplingParams(max_new_tokens=12), drafter)
    assert sum(stats.drafted) == 0
    assert ids == run(lm, [5, 6, 7], SamplingParams(max_new_tokens=12))[1]


def test_kangaroo_that_pays_here_keeps_drafting(lm, monkeypatch):
    _timers(monkeypatch, plain=0.024, round_=0.022)
    drafter = KangarooDrafter.from_checkpoint(lm, _kangaroo_checkpoint(lm, "bf16"))
    assert not drafter.off and drafter.pays and not drafter.notice
    assert drafter.metrics["speedup"] == pytest.approx(1.364, abs=1e-3)


def test_kangaroo_timed_in_this_dtype_is_not_re_timed(lm, monkeypatch):
    calls = _timers(monkeypatch, plain=1.0, round_=100.0)
    drafter = KangarooDrafter.from_checkpoint(lm, _kangaroo_checkpoint(lm, "fp32"))
    assert calls == [] and not drafter.off and drafter.retimed_speedup is None


def _medusa_checkpoint(lm, estimate_ratio: float = 1.0):
    heads = md.MedusaHeads(int(lm.model.config.hidden_size), md.MedusaSettings(4))
    settings = {**heads.settings.to_json(), "tree": [[0], [0, 0]], "pays": True,
                "quant": "bf16", "device": "cpu", "estimate_ratio": estimate_ratio,
                "accuracies": [[0.6, 0.7], [0.4, 0.5], [0.3, 0.4], [0.2, 0.3]]}
    save_checkpoint(lm, "medusa", heads.tensors(), settings, {"speedup": 1.4})


def _tree_costs(monkeypatch, per_node: float):
    """Plain step 10 ms; each tree node adds per_node ms."""
    monkeypatch.setattr(md, "tree_step_seconds",
                        lambda lm, heads, choices, ids=None, repeats=3:
                        0.010 + per_node * len(choices) / 1000)


def test_medusa_re_timed_where_no_tree_pays_decodes_plainly_and_says_so(lm, monkeypatch):
    _medusa_checkpoint(lm)
    _tree_costs(monkeypatch, per_node=8.0)  # trees cost far more than they keep
    drafter = load_drafter(lm, "medusa")
    assert not drafter.pays and drafter.tree.size == 1
    assert "Medusa is estimated at" in drafter.notice and "decoding plainly" in drafter.notice
    stats = run(lm, [5, 6, 7], SamplingParams(max_new_tokens=10), drafter)[2]
    assert sum(stats.drafted) == 0
    auto = load_drafter(lm, "auto")
    assert "medusa" not in auto.sources  # Auto leaves out what does not pay here


def test_medusa_re_timing_scales_its_estimate_by_what_calibration_measured(lm, monkeypatch):
    _tree_costs(monkeypatch, per_node=0.5)
    _medusa_checkpoint(lm, estimate_ratio=1.0)
    kept = load_drafter(lm, "medusa")
    assert kept.pays and kept.retimed_speedup > PAY_MARGIN and not kept.notice
    _medusa_checkpoint(lm, estimate_ratio=0.1)  # the heads kept a tenth of the estimate
    assert not load_drafter(lm, "medusa").pays


def _clock(monkeypatch, rounds: list[float]) -> None:
    """Injects timings: each timed round of round_seconds lasts the next of `rounds`."""
    reads = iter([t for begin in itertools.accumulate([0.0, *rounds]) for t in (begin, begin)])
    next(reads)  # a round reads the clock at its start and at its end
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: next(reads)))


def test_a_round_is_timed_without_disturbing_decoding(lm, monkeypatch):
    # The warm-up round (5 s) is left out; the median of the three timed rounds is kept.
    _clock(monkeypatch, [5.0, 0.3, 0.1, 0.2])
    drafter = KangarooDrafter(lm, Adapter(lm.model), KangarooSettings(2, 0.0, 3))
    assert round_seconds(lm, drafter.with_schedule(eta=0.0, gamma=3), repeats=3) == \
        pytest.approx(0.2)
    params = SamplingParams(max_new_tokens=16)
    assert run(lm, [5, 6, 7], params, drafter)[1] == run(lm, [5, 6, 7], params)[1]
    heads = md.MedusaHeads(int(lm.model.config.hidden_size), md.MedusaSettings(4))
    tree = md.build_tree([(0,), (1,), (0, 0)], 4)
    _clock(monkeypatch, [9.0, 0.7, 0.4])
    assert round_seconds(lm, md.MedusaDrafter(lm, heads, tree), repeats=2) == pytest.approx(0.55)
    assert torch.get_num_threads() == 1
