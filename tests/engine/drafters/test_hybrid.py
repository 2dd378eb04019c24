"""Trained drafters mixed with lookup: the merged tree, greedy exactness on every tiny
config, lossless sampling (with a broken-rule control), and Kangaroo's caches when lookup
rounds and adapter rounds alternate."""

from __future__ import annotations

import pytest
import torch

from engine import verify
from engine.config import SamplingParams
from engine.drafters.base import Draft
from engine.drafters.composite import Composite
from engine.drafters.hybrid import TreeWithChain, medusa_lookup
from engine.drafters.hybrid import kangaroo_lookup as compose_kangaroo_lookup
from engine.drafters.kangaroo import Adapter, KangarooDrafter, KangarooSettings
from engine.drafters.lookup import LookupDrafter, LookupParams
from engine.drafters.medusa import MedusaDrafter
from engine.generate import run
from engine.tree import build_tree, with_chain
from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.engine.drafters.kangaroo import test_kangaroo as kg
from tests.engine.drafters.medusa import test_medusa as md
from tests.stats_util import chi_square_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")


def repetitive_prompt(vocab: int, seed: int = 1) -> list[int]:
    """A prompt over a small vocabulary, so n-grams recur and lookup proposes often."""
    gen = torch.Generator().manual_seed(seed)
    part = [int(t) for t in torch.randint(3, vocab, (10,), generator=gen)]
    # Ends by repeating its start: the first step already has a long match.
    return part + [int(t) for t in torch.randint(3, vocab, (8,), generator=gen)] + part[:6]


# -- the merged tree and the greedy rule -------------------------------------------------


def test_with_chain_hangs_the_chain_under_the_root():
    tree = build_tree([(0,), (1,), (0, 0)], 4)  # nodes 1=(0,) 2=(1,) 3=(0,0)
    shape = with_chain(tree, 3)  # chain nodes 4 -> 5 -> 6
    assert shape.children == [[1, 2, 4], [3], [], [], [5], [6], []]
    assert shape.depths == [0, 1, 1, 2, 1, 2, 3]
    sees = [set(torch.nonzero(row).flatten().tolist()) for row in shape.mask]
    assert sees[3] == {0, 1, 3} and sees[4] == {0, 4} and sees[6] == {0, 4, 5, 6}
    chain = with_chain(build_tree([(0,), (0, 0)], 4), 2)  # a chain tree has no mask of its own
    assert [set(torch.nonzero(r).flatten().tolist()) for r in chain.mask] == [
        {0}, {0, 1}, {0, 1, 2}, {0, 3}, {0, 3, 4}]


def test_the_chain_hangs_beside_the_tree_or_stands_alone_without_one():
    tree = build_tree([(0,), (1,), (0, 0)], 4)
    merge = TreeWithChain(tree)
    tree_draft = Draft([9, 1, 2, 3], tree.children, tree.depths, tree.mask)
    merged = merge(tree_draft, [4, 5])
    assert merged.tokens == [9, 1, 2, 3, 4, 5]
    assert merged.children == with_chain(tree, 2).children
    assert merge(Draft.chain(9, []), [4, 5, 6, 7]).tokens == [9, 4, 5, 6, 7]  # no tree here
    assert merge(tree_draft, []) is tree_draft


def test_greedy_follows_the_deepest_branch_that_agrees():
    children = [[1, 2], [], [3], []]
    tokens = [9, 5, 5, 6]  # nodes 1 and 2 both guess 5; only node 2 continues with 6
    assert verify.accept_greedy(children, tokens, [5, 7, 6, 8]) == ([2, 3], 8)
    assert verify.accept_greedy([[2, 1], [], [3], []], tokens, [5, 7, 6, 8]) == ([2, 3], 8)
    assert verify.accept_greedy(children, tokens, [4, 7, 6, 8]) == ([], 4)


# -- Medusa + lookup ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_medusa_lookup_matches_plain_greedy(name, bundled_tokenizer):
    lm = md.small_vocab_model(bundled_tokenizer, name, 64)
    prompt, params = repetitive_prompt(64), SamplingParams(max_new_tokens=48)
    drafter = medusa_lookup(MedusaDrafter(lm, md.random_heads(lm), build_tree(md.TREE, 4)))
    _t, ids, stats = run(lm, prompt, params, drafter)
    assert ids == run(lm, prompt, params)[1]
    assert max(stats.drafted) > len(md.TREE)  # the lookup branch was verified too


def test_medusa_lookup_without_a_tree_is_lookup(bundled_tokenizer):
    lm = md.small_vocab_model(bundled_tokenizer, "llama-gqa", 64)
    prompt, params = repetitive_prompt(64), SamplingParams(max_new_tokens=40)
    drafter = medusa_lookup(MedusaDrafter(lm, md.random_heads(lm), build_tree([], 4)),
                            lookup=LookupParams())
    _t, ids, stats = run(lm, prompt, params, drafter)
    _t, plain_lookup, lookup_stats = run(lm, prompt, params, LookupDrafter())
    assert ids == plain_lookup == run(lm, prompt, params)[1]
    assert stats.drafted == lookup_stats.drafted


@pytest.fixture(scope="module")
def medusa_sampling_case(bundled_tokenizer):
    """An 8-token model, a small tree and a prompt whose suffix recurs (lookup drafts)."""
    lm = md.small_vocab_model(bundled_tokenizer, "llama-untied", 8, seed=3)
    prompt = [1, 5, 2, 6, 1, 5]
    tree = build_tree([(0,), (1,), (0, 0)], 4)
    drafter = medusa_lookup(MedusaDrafter(lm, md.random_heads(lm, seed=2), tree),
                            lookup=LookupParams(copy_len=3, short_len=3))
    return lm, prompt, drafter, md._exact_joint(lm, prompt, 3)


def test_medusa_lookup_sampling_is_lossless(medusa_sampling_case):
    lm, prompt, drafter, exact = medusa_sampling_case
    assert chi_square_pvalue(md._sampled_joint(lm, prompt, drafter, 3, md.RUNS), exact) > 1e-3


def test_medusa_lookup_sampling_test_catches_a_broken_rule(medusa_sampling_case, monkeypatch):
    lm, prompt, drafter, exact = medusa_sampling_case
    monkeypatch.setattr(verify, "accept_pointmass", md._forgetful_pointmass)
    assert chi_square_pvalue(md._sampled_joint(lm, prompt, drafter, 3, md.RUNS), exact) < 1e-3


# -- Kangaroo + lookup -------------------------------------------------------------------


def break_pointmass(monkeypatch) -> None:
    """Replace point-mass acceptance with a broken rule: it accepts a draft token with
    probability ~sqrt(p) instead of p (a sampling test must reject it)."""
    fair = verify.accept_pointmass

    def eager(children, tokens, target_probs, generator):
        flat = target_probs.sqrt()
        return fair(children, tokens, flat / flat.sum(-1, keepdim=True), generator)

    monkeypatch.setattr(verify, "accept_pointmass", eager)


class Counting(KangarooDrafter):
    """Counts the rounds drafted by lookup."""

    lookups = 0

    def propose_chain(self, state, tokens):
        self.lookups += 1
        return super().propose_chain(state, tokens)


def exposing_kangaroo(cls):
    """A composite `cls` exposing its Kangaroo source's state (the cache check reads it)."""

    class Exposing(cls):
        run = property(lambda self: self.sources["kangaroo"].run)
        settings = property(lambda self: self.sources["kangaroo"].settings)
        adapter = property(lambda self: self.sources["kangaroo"].adapter)
        lookups = property(lambda self: self.sources["kangaroo"].lookups)

    return Exposing


def kangaroo_lookup(lm, exit_layer=2, gamma=4, min_match=1, seed=0, cls=None):
    torch.manual_seed(seed)
    kangaroo = Counting(lm, Adapter(lm.model), KangarooSettings(exit_layer, 0.0, gamma))
    d = compose_kangaroo_lookup(kangaroo, min_match=min_match)
    d.__class__ = cls or exposing_kangaroo(Composite)  # a test view of the same drafter
    return d


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("exit_layer", [1, 2, 3])
@pytest.mark.parametrize("min_match", [1, 2])
def test_kangaroo_lookup_matches_plain_greedy(name, exit_layer, min_match, bundled_tokenizer):
    lm = make_tiny_model(name, bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    prompt, params = repetitive_prompt(64), SamplingParams(max_new_tokens=48)
    d = kangaroo_lookup(lm, exit_layer, min_match=min_match)
    _t, ids, stats = run(lm, prompt, params, d)
    assert ids == run(lm, prompt, params)[1]
    assert d.lookups < stats.steps  # the adapter drafted too
    assert d.lookups > 0 or min_match > 1  # single-token matches always occur here


def test_kangaroo_lookup_caches_stay_consistent(bundled_tokenizer, monkeypatch):
    lm = make_tiny_model("qwen2", bundled_tokenizer, vocab_size=12)  # tokens recur often
    lm.eos_ids = ()
    d = kangaroo_lookup(lm, cls=exposing_kangaroo(kg.recording(Composite)))
    kept = kg.check_caches_after_random_accepts(lm, d, [5, 6, 7, 8, 9] * 3, monkeypatch)
    assert d.lookups > 0 and max(kept) > 1  # lookup rounds left states for the adapter


def test_kangaroo_lookup_when_kangaroo_does_not_pay_is_lookup(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    prompt, params = repetitive_prompt(64), SamplingParams(max_new_tokens=40)
    d = kangaroo_lookup(lm, gamma=0, min_match=3)  # gamma 0: calibration found no gain
    _t, ids, stats = run(lm, prompt, params, d)
    _t, plain_lookup, lookup_stats = run(lm, prompt, params, LookupDrafter())
    assert ids == plain_lookup and stats.drafted == lookup_stats.drafted


def test_kangaroo_lookup_sampling_is_lossless_and_catches_a_broken_rule(
        bundled_tokenizer, monkeypatch):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=kg.VOCAB, num_layers=3)
    lm.eos_ids = ()
    prompt = [1, 4, 2, 5, 1, 4]  # (1, 4) recurs: the first round drafts from lookup
    d = kangaroo_lookup(lm, exit_layer=1, gamma=3, min_match=2, seed=3)
    exact = kg._exact_joint(lm, prompt)
    assert chi_square_pvalue(kg._sampled_joint(lm, prompt, d, 800), exact) > 1e-3
    assert d.lookups > 0
    break_pointmass(monkeypatch)
    assert chi_square_pvalue(kg._sampled_joint(lm, prompt, d, 800), exact) < 1e-3
