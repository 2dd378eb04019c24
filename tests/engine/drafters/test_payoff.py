"""Whether drafting pays where a model runs: a step drafting with a trained drafter is timed
whole at every load as a multiple of the plain step timed in turn with it, its tokens come
from calibration corrected by each reply, and where no draft beats plain decoding it decodes
plainly and says so (and Auto leaves it out)."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.config import SamplingParams
from engine.decode import timing
from engine.decode.generate import run
from engine.decode.timing import StepCost
from engine.drafters import kangaroo as kg
from engine.drafters import medusa as md
from engine.drafters import payoff
from engine.drafters.accelerators import Checkpoint, save_checkpoint
from engine.drafters.kangaroo import Adapter, KangarooDrafter, KangarooSettings
from engine.drafters.registry import load_drafter
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def lm(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=200)
    lm.step_costs[lm.target.name] = StepCost.linear(0.05)  # pinned, not timed
    return lm


def _kangaroo_checkpoint(lm, tokens: float = 1.25) -> Checkpoint:
    settings = KangarooSettings(2, 0.6, 4)
    drafter = KangarooDrafter(lm, Adapter(lm.model), settings)
    info = {"settings": {**settings.to_json(), "pays": True, "quant": lm.quant,
                         "device": "cpu", "machine": payoff.machine(lm)}}
    return Checkpoint(Path("kangaroo"), drafter.tensors(), info,
                      {"pays": True, "speedup": 1.3, "mean_accepted": tokens})


def _rounds(monkeypatch, cost: float) -> list:
    calls = []
    monkeypatch.setattr(kg, "round_ratio", lambda lm, d: calls.append(d.settings.gamma) or cost)
    return calls


def test_kangaroo_that_does_not_pay_here_decodes_plainly_and_says_so(lm, monkeypatch):
    calls = _rounds(monkeypatch, cost=1.62)  # 1.25 tokens a round: 0.77x
    drafter = KangarooDrafter.from_checkpoint(lm, _kangaroo_checkpoint(lm))
    assert calls == [2]  # timed here, even where calibration ran: rounds of ceil(1.25)
    assert drafter.off and not drafter.pays_off
    assert drafter.speedup == pytest.approx(0.77, abs=0.01)
    assert "not drafting: estimated at 0.77x plain decoding in fp32" in drafter.notice
    _t, ids, stats = run(lm, [5, 6, 7], SamplingParams(max_new_tokens=12), drafter)
    assert sum(stats.drafted) == 0
    assert ids == run(lm, [5, 6, 7], SamplingParams(max_new_tokens=12))[1]


def test_kangaroo_that_pays_here_keeps_drafting(lm, monkeypatch):
    _rounds(monkeypatch, cost=0.9)
    drafter = KangarooDrafter.from_checkpoint(lm, _kangaroo_checkpoint(lm, tokens=1.8))
    assert not drafter.off and drafter.pays_off and not drafter.notice
    assert drafter.speedup == pytest.approx(2.0)


def _medusa_checkpoint(lm, settings: dict) -> None:
    heads = md.MedusaHeads(int(lm.model.config.hidden_size), md.MedusaSettings(4))
    save_checkpoint(lm, "medusa", heads.tensors(),
                    {**heads.settings.to_json(), "pays": True, **settings}, {"speedup": 1.4})


CANDIDATES = {"candidates": [[[0], 0.6], [[0, 0], 0.4], [[1], 0.2], [[0, 0, 0], 0.25]]}


def test_medusa_that_does_not_pay_here_decodes_plainly_and_says_so(lm, monkeypatch):
    _medusa_checkpoint(lm, CANDIDATES)
    monkeypatch.setattr(md, "step_overhead", lambda lm, d, tokens: 2.0)  # dearer than any gain
    drafter = load_drafter(lm, "medusa")
    assert not drafter.pays_off and drafter.speedup < 1.0
    assert "Medusa is not drafting: estimated at" in drafter.notice
    stats = run(lm, [5, 6, 7], SamplingParams(max_new_tokens=10), drafter)[2]
    assert sum(stats.drafted) == 0
    auto = load_drafter(lm, "auto")
    assert "medusa" not in auto.sources  # Auto leaves out what does not pay here


def test_medusa_drafts_the_nodes_that_pay_at_the_heads_cost_timed_here(lm, monkeypatch):
    _medusa_checkpoint(lm, CANDIDATES)
    monkeypatch.setattr(md, "step_overhead", lambda lm, d, tokens: 0.1)
    drafter = load_drafter(lm, "medusa")
    assert drafter.pays_off and not drafter.notice
    # all four nodes: 1 + 1.45 tokens for 5 tokens' verification (1.2) + the heads (0.1)
    assert drafter.value(drafter.chances, StepCost.linear(0.05)) == \
        (4, pytest.approx(2.45 / 1.3))
    # a steeper verification keeps the two likeliest
    assert drafter.value(drafter.chances, StepCost.linear(0.3))[0] == 2


def test_an_older_checkpoint_reads_its_candidates_from_its_accuracies(lm, monkeypatch):
    monkeypatch.setattr(md, "step_overhead", lambda lm, d, tokens: 0.1)
    _medusa_checkpoint(lm, {"tree": [[0], [0, 0]], "estimate_ratio": 0.5,
                            "accuracies": [[0.6, 0.7], [0.4, 0.5], [0.3, 0.4], [0.2, 0.3]]})
    drafter = load_drafter(lm, "medusa")
    assert drafter.ranked[:2] == [(0,), (0, 0)]
    assert drafter.chances[:2] == pytest.approx([0.3, 0.12])  # path products, halved


def test_a_reply_whose_drafts_miss_stops_drafting(lm, monkeypatch):
    """Random heads claimed right 90% of the time: this reply's counts soon price them out,
    and every later step decodes plainly."""
    lm.eos_ids = ()  # every reply runs its 40 tokens
    lm.step_costs[lm.target.name] = StepCost.linear(0.2)
    tree = md.build_tree([(0,), (0, 0), (1,)], 4)
    heads = md.MedusaHeads(int(lm.model.config.hidden_size), md.MedusaSettings(4))
    with torch.no_grad():
        heads.bias.copy_(torch.randn(heads.bias.shape, generator=torch.Generator().manual_seed(0)))
    drafter = md.MedusaDrafter(lm, heads, tree, [0.9, 0.9, 0.8], overhead=0.1)
    _t, ids, stats = run(lm, [5, 6, 7], SamplingParams(max_new_tokens=40), drafter)
    assert ids == run(lm, [5, 6, 7], SamplingParams(max_new_tokens=40))[1]
    drafted = [d > 0 for d in stats.drafted]
    assert drafted[0] and not any(drafted[-10:])  # drafted first, plain at the end


def _clock(monkeypatch, seconds: list[float]) -> None:
    """Injects timings: each timed call lasts the next of `seconds`."""
    reads = iter([t for begin in itertools.accumulate([0.0, *seconds]) for t in (begin, begin)])
    next(reads)  # a call reads the clock at its start and at its end
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: next(reads)))


def test_a_drafted_step_is_timed_whole_in_turn_with_plain_steps(lm, monkeypatch):
    """Medusa's overhead is a whole drafted step (the heads, the tree verified with its
    mask, the commit) timed against plain steps, less what the step-cost curve prices
    verifying its tokens at: what the heads alone cost would leave the rest unpriced."""
    tree = md.build_tree([(0,), (0, 0), (1,)], 4)
    heads = md.MedusaHeads(int(lm.model.config.hidden_size), md.MedusaSettings(4))
    drafter = md.MedusaDrafter(lm, heads, tree, [0.5, 0.3, 0.2])
    forward, verified = lm.target.forward, []

    def counted(cache, ids, *args, **kwargs):
        verified.append(len(ids))
        return forward(cache, ids, *args, **kwargs)

    monkeypatch.setattr(lm.target, "forward", counted)
    # plain / drafted-step pairs (warm-ups untimed): ratios 1.6, 1.2, 2.0, 1.6, 1.6 -> 1.6
    _clock(monkeypatch, [1.0, 1.6, 1.0, 1.2, 1.0, 2.0, 1.0, 1.6, 1.0, 1.6])
    # less verifying the root and its likeliest node on the pinned curve: 1 + 0.05
    assert drafter.overhead() == pytest.approx(1.6 - 1.05)
    assert verified.count(2) == 6  # a warm-up and five timed steps, each verifying a node
    drafter = KangarooDrafter(lm, Adapter(lm.model), KangarooSettings(2, 0.0, 3))
    _clock(monkeypatch, [1.0, 0.5, 1.0, 1.5, 1.0, 1.0])
    assert payoff.round_ratio(lm, drafter, rounds=3) == pytest.approx(1.0)
    params = SamplingParams(max_new_tokens=16)
    assert run(lm, [5, 6, 7], params, drafter)[1] == run(lm, [5, 6, 7], params)[1]
    assert torch.get_num_threads() == 1
