"""The n-gram lookup drafter: index behaviour, greedy exactness, lossless sampling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import timing
from engine.config import SamplingParams
from engine.drafters import lookup
from engine.drafters.lookup import (
    LookupDrafter,
    LookupParams,
    LookupSource,
    NgramIndex,
)
from engine.drafters.registry import load_drafter
from engine.generate import run
from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.stats_util import chi_square_pvalue


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
    source = LookupSource(LookupParams(copy_len=5, short_len=2))
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
    seconds = {0: 0.010, 10: 0.010 * cost}
    monkeypatch.setattr(lookup, "plain_step_seconds", lambda lm: seconds[0])
    monkeypatch.setattr(lookup, "round_seconds", lambda lm, drafter: seconds[drafter.n])
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=1)
    assert lookup.fitted(lm) == LookupParams(copy_len=10, short_len=short_len)
    assert load_drafter(lm, "lookup").source.params.short_len == short_len


def test_a_long_chain_is_timed_as_drafted(bundled_tokenizer, monkeypatch):
    """The timed step verifies the pending token and ten drafts, every round."""
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=1)
    chain = lookup._FixedChain(10)
    sizes = []
    score = chain.score
    chain.score = lambda state, draft: sizes.append(draft.size) or score(state, draft)
    ticks = iter([0, 9, 9, 11, 11, 14])  # injected timings: rounds of 9 (warm-up), 2 and 3 s
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=ticks.__next__))
    assert lookup.round_seconds(lm, chain, repeats=2) == 2.5  # the timed rounds' median
    assert sizes == [11, 11, 11]  # the warm-up round and two timed ones


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
    from engine.chat import conversation, encode

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
    from engine import verify

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
        return fair(children, tokens, target_probs.sqrt() / target_probs.sqrt().sum(-1, keepdim=True), generator)

    monkeypatch.setattr(verify, "accept_pointmass", eager)
    assert chi_square_pvalue(_second_token_counts(lm, prompt, 1000), second) < 0.001
