"""Auto: copying while a 3-gram match holds, otherwise the arm with the best calibrated
speedup (Off when none pays); exact greedy replies and consistent caches while copy rounds
and the arm alternate within one reply, lossless sampling, and the registry building it
from whatever is trained."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.config import SamplingParams
from engine.drafters.auto import COPY, KANGAROO, MEDUSA, auto, fastest_arm
from engine.drafters.composite import Composite
from engine.drafters.kangaroo import Adapter, KangarooDrafter, KangarooSettings
from engine.drafters.lookup import LookupParams
from engine.drafters.medusa import MedusaDrafter
from engine.drafters.registry import ACCEL_LABELS, load_drafter
from engine.errors import AcceleratorError
from engine.generate import run
from engine.tree import build_tree
from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.engine.drafters.kangaroo import test_kangaroo as kg
from tests.engine.drafters.medusa import test_medusa as md
from tests.engine.drafters.test_hybrid import break_pointmass, repetitive_prompt
from tests.stats_util import chi_square_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")
# Single-token matches count as copies: a random tiny model copies no longer, and the tests
# need copy rounds and the arm's rounds to alternate.
SINGLE = LookupParams(max_ngram=1, min_ngram=1)


def drafters(lm, exit_layer=2, gamma=4, seed=0):
    """Random Medusa heads and a random Kangaroo adapter (eta 0: it drafts gamma tokens)."""
    torch.manual_seed(seed)
    m = MedusaDrafter(lm, md.random_heads(lm, seed=seed + 1), build_tree(md.TREE, 4))
    k = KangarooDrafter(lm, Adapter(lm.model), KangarooSettings(exit_layer, 0.0, gamma))
    return m, k


class Counting(Composite):
    """Auto counting how each step drafted, over every reply."""

    def start(self, state, prefill):
        super().start(state, prefill)
        self.all_steps = getattr(self, "all_steps", Counter())

    def commit(self, state, draft, path):
        self.all_steps[self.kind] += 1
        super().commit(state, draft, path)


def make_auto(lm, arm, cls=Counting, lookup=SINGLE, **kw):
    m, k = drafters(lm, **kw)
    a = auto(arm, {"medusa": m, "kangaroo": k}, lookup)
    a.__class__ = cls  # a test view of the same drafter
    return a


@pytest.fixture(scope="module")
def tiny(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    return lm


# -- choosing ---------------------------------------------------------------------------


def test_the_arm_is_the_best_calibrated_speedup_or_off():
    assert fastest_arm({MEDUSA: 1.3, KANGAROO: 1.2}) == MEDUSA
    assert fastest_arm({MEDUSA: 1.1, KANGAROO: 1.25}) == KANGAROO
    assert fastest_arm({MEDUSA: 0.9}) == "off"  # nothing beats plain decoding
    assert fastest_arm({}) == "off"


@pytest.mark.parametrize("arm", [KANGAROO, MEDUSA, "off"])
def test_each_step_copies_or_takes_the_arm(tiny, arm):
    a = make_auto(tiny, arm)
    params = SamplingParams(max_new_tokens=40)
    for prompt in (repetitive_prompt(64), [9, 8, 7, 6]):
        assert run(tiny, prompt, params, a)[1] == run(tiny, prompt, params)[1]
    assert set(a.all_steps) == {COPY, arm}  # nothing else, ever
    assert a.used() == f"auto:{arm}" and a.wants_hidden == (arm != "off")


def test_copying_is_the_full_lookup_continuation_and_adapts_nothing_else(tiny):
    a = make_auto(tiny, MEDUSA, lookup=LookupParams())  # copies on 3-gram matches only
    prompt = [3, 4, 5, 6, 7, 8] * 4
    run(tiny, prompt, SamplingParams(max_new_tokens=30), a)
    assert a.last_reply[COPY] >= 1 and a.last_reply[MEDUSA] >= 1


def test_the_reason_names_the_arm_its_gain_and_the_mix(tiny):
    m, k = drafters(tiny)
    a = auto(MEDUSA, {"medusa": m, "kangaroo": k}, speedup=1.6, labels=ACCEL_LABELS)
    assert a.reason() == ("Auto copies from the conversation where it can, else drafts with "
                          "Medusa+lookup (1.60x Off when calibrated)")
    a.steps = Counter({MEDUSA: 9, COPY: 1})  # as a reply leaves it
    a.finish(None)
    assert a.reason().endswith("; the last reply: Medusa+lookup 90%, copying 10% of the steps")
    with pytest.raises(ValueError, match="needs its trained drafter"):
        auto(KANGAROO, {"medusa": m})


# -- exactness, caches, sampling ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("arm", [KANGAROO, MEDUSA])
def test_greedy_replies_stay_exact_as_copies_and_the_arm_alternate(name, arm,
                                                                    bundled_tokenizer):
    lm = make_tiny_model(name, bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    a = make_auto(lm, arm)
    params = SamplingParams(max_new_tokens=40)
    for prompt in (repetitive_prompt(64), [9, 8, 7, 6], repetitive_prompt(64, seed=4)):
        assert run(lm, prompt, params, a)[1] == run(lm, prompt, params)[1]
    assert a.all_steps[COPY] > 0 and a.all_steps[arm] > 0


class Recording(kg.recording(Composite)):
    """Auto exposing its Kangaroo drafter's state to the cache check."""

    run = property(lambda self: self.sources["kangaroo"].run)
    settings = property(lambda self: self.sources["kangaroo"].settings)
    adapter = property(lambda self: self.sources["kangaroo"].adapter)


@pytest.mark.parametrize("exit_layer", [1, 2])
def test_every_cache_matches_one_by_one_decoding_through_copies(
        exit_layer, bundled_tokenizer, monkeypatch):
    lm = make_tiny_model("qwen2", bundled_tokenizer, vocab_size=12)  # tokens recur often
    lm.eos_ids = ()
    a = make_auto(lm, KANGAROO, cls=Recording, exit_layer=exit_layer)
    kept = kg.check_caches_after_random_accepts(lm, a, [5, 6, 7, 8, 9] * 3, monkeypatch)
    assert max(kept) > 1  # copy rounds left states for the adapter to read
    assert set(a.last_reply) == {COPY, KANGAROO}


@pytest.mark.parametrize("arm", [KANGAROO, MEDUSA])
def test_sampling_is_lossless_and_the_test_catches_a_broken_rule(arm, bundled_tokenizer,
                                                                monkeypatch):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=kg.VOCAB, num_layers=3)
    lm.eos_ids = ()
    prompt = [1, 4, 2, 5, 1, 4]  # (1, 4) recurs: copies happen too
    a = make_auto(lm, arm, exit_layer=1, gamma=3, seed=3)
    exact = kg._exact_joint(lm, prompt)
    assert chi_square_pvalue(kg._sampled_joint(lm, prompt, a, 800), exact) > 1e-3
    assert a.all_steps[COPY] > 0 and a.all_steps[arm] > 0
    break_pointmass(monkeypatch)
    assert chi_square_pvalue(kg._sampled_joint(lm, prompt, a, 800), exact) < 1e-3


# -- the registry ------------------------------------------------------------------------


def test_registry_builds_auto_from_what_is_trained(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    a = load_drafter(lm, "auto")
    assert a.used() == "auto:off"  # nothing trained yet
    assert set(a.sources) == {"lookup", "datastore"} and not a.wants_hidden
    with pytest.raises(AcceleratorError, match="train --method medusa"):
        load_drafter(lm, "medusa+lookup")
    with pytest.raises(AcceleratorError, match="train --method kangaroo"):
        load_drafter(lm, "kangaroo+lookup")
