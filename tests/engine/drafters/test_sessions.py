"""Drafters are shared, sessions are per reply: two replies interleaved step by step on one
drafter give exactly what they give one after the other, for every method; and a new source
is one module and one registry row, which Auto then uses where its offers pay."""

from __future__ import annotations

import pytest

from engine.config import SamplingParams
from engine.datastore.memory import Datastore
from engine.decode.generate import generate, run
from engine.drafters import registry
from engine.drafters.datastore_source import StoreDrafter
from engine.drafters.grammar_source import GrammarDrafter
from engine.drafters.lookup import LookupDrafter, LookupParams
from engine.drafters.registry import ACCEL_CHOICES, Method, compose, load_drafter
from tests.conftest import make_tiny_model
from tests.engine.decode.toy_grammar import PATTERN, ToyGrammar
from tests.engine.drafters.test_composite import kangaroo_of, medusa_of, repetitive_prompt
from tests.engine.drafters.toy_source import ToyDrafter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(bundled_tokenizer):
    lm = make_tiny_model("qwen2", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    return lm


def sources(lm) -> dict:
    """Every source, trained ones random (measured at 1.5x), the store holding replies."""
    store = Datastore("test")
    store.add_all(run(lm, p, SamplingParams(max_new_tokens=30))[1]
                  for p in (repetitive_prompt(64, seed=2), repetitive_prompt(64, seed=3)))
    return {"lookup": LookupDrafter(LookupParams(max_ngram=2)), "medusa": medusa_of(lm),
            "kangaroo": kangaroo_of(lm), "datastore": StoreDrafter(store),
            "grammar": GrammarDrafter()}


def outcome(events) -> tuple:
    """What a reply gave: its tokens and every figure of its stats about drafting."""
    ids = [t for e in events for t in e.token_ids]
    s = events[-1].stats
    return (ids, s.accepted, s.drafted, s.step_kinds, s.kind_accepted, s.datastore_drafted,
            s.datastore_accepted)


def interleaved(lm, drafter, asks, grammar=None) -> list[tuple]:
    """The replies to `asks` (prompt, params) advanced one step each in turn."""
    streams = [generate(lm, p, params, drafter, grammar=grammar) for p, params in asks]
    events: list[list] = [[] for _ in asks]
    live = set(range(len(asks)))
    while live:
        for i in sorted(live):
            event = next(streams[i])
            events[i].append(event)
            if event.done:
                live.discard(i)
    return [outcome(e) for e in events]


@pytest.mark.parametrize("method", [m for m in ACCEL_CHOICES if m != "off"] + ["off"])
def test_two_replies_interleaved_on_one_drafter_equal_them_one_after_the_other(tiny, method):
    built = sources(tiny)
    drafter = compose(tiny, method, built.__getitem__)
    asks = [(repetitive_prompt(64), SamplingParams(max_new_tokens=32)),
            (repetitive_prompt(64, seed=4), SamplingParams(temperature=1.0, seed=7,
                                                           max_new_tokens=32)),
            (repetitive_prompt(64, seed=5), SamplingParams(max_new_tokens=24))]
    # the grammar's source drafts only in replies that have one
    grammar = ToyGrammar(PATTERN) if method == "grammar" else None
    alone = [outcome(list(generate(tiny, p, params, drafter, grammar=grammar)))
             for p, params in asks]
    assert interleaved(tiny, drafter, asks, grammar) == alone
    if method != "off":
        assert any(sum(a[1]) for a in alone)  # drafts were kept: the sessions did work


def test_a_new_source_is_one_module_and_one_registry_row(tiny, monkeypatch):
    prompt, params = repetitive_prompt(64, seed=6), SamplingParams(max_new_tokens=30)
    script = run(tiny, prompt, params)[1]  # the reply the toy expects
    shipped = registry.METHODS
    for sure, used in ((0.95, True), (0.0, False)):  # 0: its drafts are never kept
        row = Method("toy", "Toy", lambda lm, ckpt, s=sure: ToyDrafter(script, s))
        monkeypatch.setattr(registry, "METHODS", (*shipped, row))
        auto = load_drafter(tiny, "auto")
        assert "toy" in auto.sources
        _t, ids, stats = run(tiny, prompt, params, auto)
        assert ids == run(tiny, prompt, params)[1]
        toy = sum(n for kind, n in stats.kind_accepted.items() if "toy" in kind)
        assert any("toy" in kind for kind in stats.step_kinds) == used
        if used:  # the toy's drafts are right: they carry most of the reply
            assert toy > params.max_new_tokens // 2
