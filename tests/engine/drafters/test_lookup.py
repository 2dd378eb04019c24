"""The n-gram lookup drafter: index behaviour, greedy exactness, lossless sampling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.config import SamplingParams
from engine.decode import timing
from engine.decode.generate import run
from engine.drafters import lookup
from engine.drafters.lookup import LookupDrafter, LookupParams, LookupSession, NgramIndex
from engine.drafters.registry import load_drafter
from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.stats_util import chi_square_pvalue, whole


def test_index_finds_longest_most_recent_match():
    index = NgramIndex(1, 3)
    index.extend([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7])
    # suffix (6, 7): last earlier occurrence is followed by 9, 2, ...
    assert index.match(3)[0] == [9, 2, 6]
    index.extend([9])
    # suffix (6, 7, 9) occurred once before, followed by 2, 6, 7, 9
    assert index.match(10)[0] == [2, 6, 7, 9]


def test_index_never_matches_the_suffix_itself():
    index = NgramIndex(1, 2)
    index.extend([1, 2, 3])
    assert index.match(4)[0] == []


def test_a_copy_drafts_long_a_short_match_short_within_the_room_left():
    source = LookupSession(LookupParams(copy_len=5, short_len=2))
    ids = list(range(20)) + [3]  # 3 occurred before, followed by 4, 5, 6, ...
    assert source.match(ids, 10) == ([4, 5], 1)  # a short match: a short chain
    assert source.match(ids, 1)[0] == [4]  # no drafts past the room left
    assert not source.copying(1)
    ids += [4, 5]  # (3, 4, 5) matches now: a copy in progress
    chain, n = source.match(ids, 10)
    assert chain == [6, 7, 8, 9, 10] and source.copying(n)
    assert source.match(ids, 3)[0] == [6, 7, 8]


@pytest.mark.parametrize("cost, short_len", [(2.2, 2), (1.15, 10)])
def test_shorter_matches_draft_long_chains_only_where_they_cost_little(
        cost, short_len, bundled_tokenizer, monkeypatch):
    """fp32 on a CPU: ten drafts cost ~2.2 plain steps; bf16 ~1.15."""
    curve = timing.StepCost(((1, 1.0), (11, cost)))
    monkeypatch.setattr(lookup, "step_cost", lambda lm, sampling=None: curve)
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=1)
    assert lookup.fitted(lm) == LookupParams(copy_len=10, short_len=short_len)
    assert load_drafter(lm, "lookup").sources["lookup"].params.short_len == short_len


def test_the_step_cost_is_timed_once_per_loaded_target(bundled_tokenizer, monkeypatch):
    """Steps of each size are timed in turn; the curve is cached on the loaded model."""
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=1)
    sizes = _sized_clock(lm, monkeypatch)
    curve = timing.step_cost(lm)
    assert curve.plain_s == 1.0 and curve(4) == 4.0 and curve(3) == 4.0  # padded to 4
    timed = len(sizes)
    assert timing.step_cost(lm) is curve and timing.plain_step_seconds(lm) == 1.0
    assert len(sizes) == timed  # cached: nothing timed again
    assert set(sizes) == {1, 2, 4, 8, 16, 32}
    assert sizes.count(4) == 1 + timing.ROUNDS  # warmed once, then timed each round


def _sized_clock(lm, monkeypatch) -> list[int]:
    """Injects timings: the clock reads the tokens forwarded so far, so a step of n tokens
    lasts n seconds. Returns the sizes of the steps forwarded (the prefill aside)."""
    sizes, forward = [], lm.target.forward
    total = [0]

    def counted(cache, tokens, start, **kw):
        total[0] += len(tokens)
        if start:
            sizes.append(len(tokens))
        return forward(cache, tokens, start, **kw)

    monkeypatch.setattr(lm.target, "forward", counted)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: float(total[0])))
    return sizes


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_greedy_exact_on_tiny_configs(name, bundled_tokenizer):
    # A 64-token vocabulary makes tokens recur, so drafts are proposed, some right, some wrong.
    lm = make_tiny_model(name, bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()  # run the full length
    prompt = [int(t) for t in torch.randint(3, 64, (24,), generator=torch.Generator().manual_seed(1))]
    params = SamplingParams(max_new_tokens=48)
    _t, plain, _ = run(lm, prompt, params)
    _t, drafted, stats = run(lm, prompt, params, LookupDrafter())
    assert drafted == plain
    assert sum(stats.drafted) > 0  # acceptance is exercised on the bundled model below


@pytest.mark.slow
def test_greedy_exact_and_accepting_on_bundled_model(bundled_lm):
    from engine.decode.chat_template import conversation, encode

    text = ("def area(width, height):\n    return width * height\n\n"
            "def perimeter(width, height):\n    return 2 * (width + height)\n")
    ids = encode(bundled_lm.tokenizer, conversation(f"Repeat this code exactly:\n{text}"))
    params = SamplingParams(max_new_tokens=64)
    _t, plain, _ = run(bundled_lm, ids, params)
    _t, drafted, stats = run(bundled_lm, ids, params, LookupDrafter())
    assert drafted == plain
    assert stats.mean_accepted > 1.5  # copying from the prompt pays


def _second_token_counts(lm, prompt, n):
    counts = torch.zeros(8, dtype=torch.long)
    for seed in range(n):
        # Three tokens: the second step has room for a draft (none is made past the budget).
        params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=seed)
        _t, ids, _ = run(lm, prompt, params, LookupDrafter(LookupParams(copy_len=3, short_len=3)))
        counts[ids[1]] += 1
    return counts


def test_lossless_sampling_distribution(bundled_tokenizer, monkeypatch):
    """Second-token frequencies with lookup drafts match plain sampling's distribution, and
    the same test rejects an acceptance rule that accepts drafts too eagerly."""
    from engine.decode import verify

    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=8)
    lm.eos_ids = ()  # always three tokens
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # the suffix (1, 2) is followed by 3: drafted
    # Exact distribution of the second token, marginalised over the first.
    with torch.no_grad():
        first = lm.model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        second = torch.zeros(8)
        for t in range(8):
            second += first[t] * lm.model(torch.tensor([prompt + [t]])).logits[0, -1].softmax(-1)
    assert chi_square_pvalue(_second_token_counts(lm, prompt, 1000), second) > 0.001

    fair = verify.accept_pointmass

    def eager(children, tokens, target_probs, generator):
        # Broken on purpose: accepts a proposal with probability ~sqrt(p) instead of p.
        root = whole(target_probs, len(tokens)).sqrt()
        return fair(children, tokens, root / root.sum(-1, keepdim=True), generator)

    monkeypatch.setattr(verify, "accept_pointmass", eager)
    assert chi_square_pvalue(_second_token_counts(lm, prompt, 1000), second) < 0.001
