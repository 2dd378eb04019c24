"""Where a reply's speed came from: each model step counted once under the source that
drafted it, the accepted draft tokens under the same sources, and the share that repeated
earlier text (what Compare warns about)."""

from __future__ import annotations

import pytest

from app.sources import SourceMix, label, mix_of
from engine.config import SamplingParams
from engine.decode.generate import run
from engine.drafters.lookup import LookupDrafter, LookupParams
from tests.conftest import make_tiny_model
from tests.engine.drafters.test_auto import make_auto
from tests.engine.drafters.test_composite import repetitive_prompt

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    return lm


def test_a_composites_steps_and_gains_add_up_to_the_replys(tiny):
    a = make_auto(tiny, "medusa")
    _text, _ids, stats = run(tiny, repetitive_prompt(64), SamplingParams(max_new_tokens=40), a)
    mix = mix_of(a.used(), stats.to_json())
    assert {"conversation", "medusa"} <= set(mix.steps) <= {"conversation", "medusa", "plain"}
    assert mix.total_steps == stats.steps
    assert sum(mix.gained.values()) == sum(stats.accepted)
    medusa = sum(n for k, n in stats.step_kinds.items() if k.startswith("medusa"))
    assert mix.steps["conversation"] == stats.step_kinds["copy"]
    assert mix.steps["medusa"] == medusa


def test_a_single_drafter_counts_the_steps_it_drafted_nothing_as_plain(tiny):
    _text, _ids, stats = run(tiny, [9, 8, 7, 6, 9, 8, 7], SamplingParams(max_new_tokens=30),
                             LookupDrafter(LookupParams(max_ngram=2, min_ngram=1)))
    mix = mix_of("lookup", stats.to_json())
    drafted = sum(d > 0 for d in stats.drafted)
    assert 0 < drafted < stats.steps  # the prompt was chosen to give both kinds of step
    assert mix.steps == {"conversation": drafted, "plain": stats.steps - drafted}
    assert mix.gained == {"conversation": sum(stats.accepted)}
    assert mix_of("off", run(tiny, [1, 2], SamplingParams(max_new_tokens=5))[2].to_json()
                  ).steps == {"plain": 4}


def test_shares_are_ranked_and_the_top_source_named():
    mix = SourceMix({"plain": 3, "medusa": 10, "conversation": 7}, {})
    assert mix.shares() == [("medusa", 0.5), ("conversation", 0.35), ("plain", 0.15)]
    assert mix.top == "medusa" and label(mix.top) == "Medusa"
    assert label("conversation") == "copies from this conversation"


def test_the_repeated_share_counts_copies_and_datastore_tokens_even_inside_joined_steps():
    stats = {"drafting_steps": 9, "steps": 12, "datastore_accepted": 9,
             "step_kinds": {"copy": 4, "datastore": 2, "medusa+datastore": 5, "off": 1},
             "kind_accepted": {"copy": 10, "datastore": 5, "medusa+datastore": 9, "off": 0}}
    mix = mix_of("auto:medusa", stats)
    assert mix.steps == {"conversation": 4, "datastore": 2, "medusa": 5, "plain": 1}
    assert mix.store_joined == 4  # 9 datastore tokens, 5 of them in its own steps
    assert mix.repeated_share == pytest.approx((10 + 5 + 4) / 24)
    assert SourceMix({"medusa": 3}, {"medusa": 0}).repeated_share == 0.0


def test_a_reply_stored_before_the_mix_was_recorded_has_none():
    assert mix_of("auto:off", {"tokens": 3, "steps": 2}) is None
    assert mix_of("lookup", {}) is None
