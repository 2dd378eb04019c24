"""Auto: every ready source under the one rule, so copying while a 3-gram match holds and
otherwise the trained source measured fastest (plain decoding when none pays); exact greedy
replies and consistent caches while copy rounds and trained rounds alternate, lossless
sampling, and the registry building it from whatever is trained."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.config import SamplingParams
from engine.decode.generate import run
from engine.decode.stats import GenerationStats
from engine.drafters.auto import COPY, JOIN_MARGIN, auto, fastest, joining
from engine.drafters.lookup import LookupDrafter, LookupParams
from engine.drafters.registry import ACCEL_LABELS, load_drafter
from engine.errors import AcceleratorError
from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.engine.drafters.kangaroo import test_kangaroo as kg
from tests.engine.drafters.spy import Spy
from tests.engine.drafters.test_composite import (
    SINGLE,
    break_pointmass,
    kangaroo_of,
    medusa_of,
    repetitive_prompt,
)
from tests.stats_util import chi_square_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")
KANGAROO, MEDUSA = "kangaroo", "medusa"


def make_auto(lm, best, lookup=SINGLE, exit_layer=2, gamma=4, seed=0, chance=0.5) -> Spy:
    """Auto over lookup, random Medusa heads and a random Kangaroo adapter, `best` the only
    one estimated to pay ("off": neither): Medusa's nodes measured kept with chance**depth,
    Kangaroo's rounds keeping `tokens` for 1.2 plain steps (2.5x, or 0.83x: left out)."""
    chance = chance if best == MEDUSA else 0.02
    tokens = 3.0 if best == KANGAROO else 1.0
    m = medusa_of(lm, seed=seed + 1, chance=chance)
    k = kangaroo_of(lm, exit_layer, gamma, seed=seed, tokens=tokens)
    return Spy(auto({"lookup": LookupDrafter(lookup), MEDUSA: m, KANGAROO: k},
                    labels=ACCEL_LABELS))


@pytest.fixture(scope="module")
def tiny(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    return lm


# -- choosing ---------------------------------------------------------------------------


def test_the_lead_is_the_best_measured_speedup_or_off():
    d = lambda s: SimpleNamespace(speedup=s)  # noqa: E731
    assert fastest({MEDUSA: d(1.3), KANGAROO: d(1.2), "lookup": d(None)}) == MEDUSA
    assert fastest({MEDUSA: d(1.1), KANGAROO: d(1.25)}) == KANGAROO
    assert fastest({MEDUSA: d(0.9)}) == "off"  # nothing beats plain decoding
    assert fastest({}) == "off"


def test_a_trained_source_joins_only_where_it_pays_by_the_margin():
    """Its work runs on every Auto step, its drafts win only some: a trained source
    estimated barely faster than plain decoding would slow Auto down."""
    d = lambda s, pays=True: SimpleNamespace(speedup=s, pays_off=pays)  # noqa: E731
    found = joining({"lookup": d(None), "datastore": d(None), MEDUSA: d(1.04),
                     KANGAROO: d(JOIN_MARGIN + 0.2), "grammar": d(None, pays=False)})
    assert set(found) == {"lookup", "datastore", KANGAROO}
    assert set(joining({MEDUSA: d(JOIN_MARGIN)})) == {MEDUSA}


@pytest.mark.parametrize("best", [KANGAROO, MEDUSA, "off"])
def test_each_step_copies_or_takes_the_fastest_source(tiny, best):
    a = make_auto(tiny, best)
    params = SamplingParams(max_new_tokens=40)
    for prompt in (repetitive_prompt(64), [9, 8, 7, 6]):
        assert run(tiny, prompt, params, a)[1] == run(tiny, prompt, params)[1]
    firsts = {kind.split("+")[0] for kind in a.steps} - {"off"}  # off: no room left
    assert firsts == {COPY, best} or (best == "off" and firsts == {COPY})  # nothing else
    assert a.used() == f"auto:{best}"
    assert a.wants_hidden == (best != "off")  # what does not pay is left out


def test_copies_and_the_trained_source_share_a_reply(tiny):
    a = make_auto(tiny, MEDUSA, lookup=LookupParams())  # copies on 3-gram matches only
    prompt = [3, 4, 5, 6, 7, 8] * 4
    _t, _ids, stats = run(tiny, prompt, SamplingParams(max_new_tokens=30), a)
    assert stats.step_kinds[COPY] >= 1
    assert any(k.startswith(MEDUSA) for k in stats.step_kinds)


def test_the_reason_names_the_lead_its_gain_and_the_mix(tiny):
    a = make_auto(tiny, MEDUSA)
    assert a.reason() == ("Auto copies from the conversation where it can, else drafts with "
                          "Medusa (estimated 3.61x Off here)")
    stats = GenerationStats(step_kinds={"medusa+lookup": 9, COPY: 1})
    assert a.reason(stats).endswith("; this reply: Medusa+lookup 90%, copying 10% of the steps")
    assert make_auto(tiny, "off").reason().endswith("else drafts with plain decoding")


# -- exactness, caches, sampling ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("best", [KANGAROO, MEDUSA])
def test_greedy_replies_stay_exact_as_copies_and_the_lead_alternate(name, best,
                                                                    bundled_tokenizer):
    lm = make_tiny_model(name, bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    a = make_auto(lm, best)
    params = SamplingParams(max_new_tokens=40)
    for prompt in (repetitive_prompt(64), [9, 8, 7, 6], repetitive_prompt(64, seed=4)):
        assert run(lm, prompt, params, a)[1] == run(lm, prompt, params)[1]
    assert a.steps[COPY] > 0 and any(k.startswith(best) for k in a.steps)


@pytest.mark.parametrize("exit_layer", [1, 2])
def test_every_cache_matches_one_by_one_decoding_through_copies(
        exit_layer, bundled_tokenizer, monkeypatch):
    lm = make_tiny_model("qwen2", bundled_tokenizer, vocab_size=12)  # tokens recur often
    lm.eos_ids = ()
    a = make_auto(lm, KANGAROO, exit_layer=exit_layer)
    d = kg.recording(a, a.inner.sources[KANGAROO])
    kept = kg.check_caches_after_random_accepts(lm, d, [5, 6, 7, 8, 9] * 3, monkeypatch)
    assert max(kept) > 1  # copy rounds left states for the adapter to read
    assert set(a.steps) - {"off"} == {COPY, KANGAROO}  # off: the last step, no room left


@pytest.mark.parametrize("best", [KANGAROO, MEDUSA])
def test_sampling_is_lossless_and_the_test_catches_a_broken_rule(best, bundled_tokenizer,
                                                                 monkeypatch):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=kg.VOCAB, num_layers=3)
    lm.eos_ids = ()
    prompt = [1, 4, 2, 5, 1, 4]  # (1, 4) recurs: copies happen too
    a = make_auto(lm, best, exit_layer=1, gamma=3, seed=3, chance=0.25)  # copies win some
    exact = kg._exact_joint(lm, prompt)
    assert chi_square_pvalue(kg._sampled_joint(lm, prompt, a, 800), exact) > 1e-3
    assert a.steps[COPY] > 0 and any(k.startswith(best) for k in a.steps)
    break_pointmass(monkeypatch)
    assert chi_square_pvalue(kg._sampled_joint(lm, prompt, a, 800), exact) < 1e-3


# -- the registry ------------------------------------------------------------------------


def test_registry_builds_auto_from_what_is_trained(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    a = load_drafter(lm, "auto")
    assert a.used() == "auto:off"  # nothing trained yet
    assert set(a.sources) == {"lookup", "datastore", "grammar"} and not a.wants_hidden
    with pytest.raises(AcceleratorError, match="train --method medusa"):
        load_drafter(lm, "medusa+lookup")
    with pytest.raises(AcceleratorError, match="train --method kangaroo"):
        load_drafter(lm, "kangaroo+lookup")
