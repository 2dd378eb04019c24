"""Sampling math on hand-made logits, and the decode loop's sampling distribution."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.config import SamplingParams
from engine.decode import sampling
from engine.decode.generate import run
from engine.decode.sampling import draw, filter_logits, logits_to_probs
from tests.conftest import make_tiny_model
from tests.stats_util import chi_square_pvalue


def test_top_k_keeps_k_best():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    out = filter_logits(logits, top_k=2)
    assert torch.isinf(out[[0, 3]]).all() and torch.isfinite(out[[1, 2]]).all()


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = filter_logits(probs.log(), top_p=0.7)  # 0.5 < 0.7 so 0.3 is needed; 0.8 >= 0.7 stops
    assert torch.isfinite(out[:2]).all() and torch.isinf(out[2:]).all()
    assert torch.isfinite(filter_logits(probs.log(), top_p=0.5)[:1]).all()
    assert torch.isinf(filter_logits(probs.log(), top_p=0.5)[1:]).all()


def test_greedy_is_one_hot_argmax():
    probs = logits_to_probs(torch.tensor([0.1, 2.0, 1.0]), SamplingParams())
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_temperature_scales_logits():
    logits = torch.tensor([0.0, 1.0])
    p = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(p, torch.softmax(logits / 2.0, -1))


def test_chi_square_helper_rejects_wrong_distribution():
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    good = torch.bincount(torch.multinomial(p, 3000, replacement=True), minlength=3)
    bad = torch.bincount(torch.multinomial(torch.tensor([0.4, 0.35, 0.25]), 3000, replacement=True), minlength=3)
    assert chi_square_pvalue(good, p) > 0.001
    assert chi_square_pvalue(bad, p) < 0.001


def _first_token_counts(lm, prompt, params, n):
    counts = torch.zeros(lm.model.config.vocab_size, dtype=torch.long)
    for seed in range(n):
        p = SamplingParams(temperature=params.temperature, top_p=params.top_p,
                           top_k=params.top_k, max_new_tokens=1, seed=seed)
        _text, ids, _stats = run(lm, prompt, p)
        counts[ids[0]] += 1
    return counts


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The next-token distribution by transformers' own warpers, in generate()'s order
    (temperature, top-k, top-p): an implementation independent of engine.decode.sampling."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    ids = torch.zeros((1, 1), dtype=torch.long)
    return torch.softmax(warpers(ids, logits[None].float()), -1)[0]


def _expected(lm, prompt, params):
    with torch.no_grad():
        logits = lm.model(torch.tensor([prompt])).logits[0, -1]
    return reference_probs(logits, params)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.8, 8, 0.9), (2.0, 3, 0.5), (0.5, 0, 0.3)])
def test_filters_match_transformers_warpers(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    for _ in range(50):
        logits = torch.randn(32, generator=gen) * 3
        assert torch.allclose(logits_to_probs(logits, params), reference_probs(logits, params),
                              atol=1e-6)


def test_loop_samples_match_softmax_after_top_k_top_p(bundled_tokenizer):
    """Empirical next-token frequencies over many seeded runs match softmax(logits/T) after
    top-k/top-p, and the same check rejects the distribution without the filters."""
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=12)
    prompt = [1, 5, 7, 3]
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9)
    counts = _first_token_counts(lm, prompt, params, 1500)
    assert chi_square_pvalue(counts, _expected(lm, prompt, params)) > 0.001
    unfiltered = _expected(lm, prompt, SamplingParams(temperature=0.8))
    assert chi_square_pvalue(counts, unfiltered) < 0.001


def test_same_seed_same_output(bundled_tokenizer):
    lm = make_tiny_model("llama-mha", bundled_tokenizer)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=24, seed=7)
    a = run(lm, [1, 2, 3, 4], params)[1]
    b = run(lm, [1, 2, 3, 4], params)[1]
    c = run(lm, [1, 2, 3, 4], SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=24, seed=8))[1]
    assert a == b
    assert a != c


def test_draws_follow_the_weights_and_never_pick_a_weightless_token(monkeypatch):
    weights = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(3000):
        got = draw(weights, gen)
        assert got.shape == (2, 1) and int(got[1]) == 5  # unnormalised rows draw alike
        counts[int(got[0])] += 1
    assert chi_square_pvalue(counts, weights[0]) > 1e-3
    # the ends of the uniform range: 0, and the largest float64 below 1
    for u in (0.0, 1.0 - 2.0 ** -53):
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full(a[0], u,
                                                                          dtype=torch.float64))
        edge = torch.tensor([0.0, 0.3, 0.7, 0.0]) * 0.1
        assert edge[int(draw(edge, gen))] > 0


@pytest.mark.parametrize("rows", ["peaked", "mixed"])
def test_a_cpu_nucleus_from_the_likeliest_tokens_is_the_sorted_one(rows, monkeypatch):
    """A CPU decides top-p among a row's likeliest tokens where those reach top_p, and
    sorts the whole row where they do not: the same nucleus as transformers' warper."""
    monkeypatch.setattr(sampling, "NUCLEUS_FIRST", 8)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 500, generator=gen)
    logits[:, :4] += 9.0  # four likely tokens: a nucleus of 0.9 within the first eight
    if rows == "mixed":
        logits[3] = torch.randn(500, generator=gen)  # flat: a nucleus of hundreds
    params = SamplingParams(temperature=1.0, top_p=0.9)
    want = torch.stack([reference_probs(row, params) for row in logits])
    assert torch.allclose(logits_to_probs(logits, params), want, atol=1e-6)
    assert (want > 0).sum(-1).max() > (8 if rows == "mixed" else 0)


@pytest.mark.parametrize("first", [4, 500])
def test_tied_tokens_at_the_nucleus_edge_are_kept_or_dropped_together(first, monkeypatch):
    """A low-bit LM head gives equal logits often: two tokens tied where the nucleus closes
    share one verdict, on the likeliest-first path and the whole-row sort alike, in any
    order the vocabulary puts them."""
    monkeypatch.setattr(sampling, "NUCLEUS_FIRST", first)
    row = torch.full((500,), -20.0)
    row[:4] = torch.tensor([3.0, 2.0, 1.0, 1.0])  # 0.61, 0.22, 0.08, 0.08 of the mass
    params = SamplingParams(temperature=1.0, top_p=0.85)  # 0.61 + 0.22 < 0.85 <= + 0.08
    shuffled = torch.randperm(500, generator=torch.Generator().manual_seed(0))
    for perm in (torch.arange(500), shuffled):
        probs = logits_to_probs(row[perm][None], params)[0]
        kept = probs[torch.argsort(perm)] > 0  # back in the row's own order
        assert kept[:4].tolist() == [True, True, True, True] and not kept[4:].any()
        assert torch.isclose(probs.sum(), torch.tensor(1.0))
