"""A reply's drafts are priced by its own kind of step: greedy replies by the greedy curve
timed at load, sampled replies by the sampled curve of their settings (timed on the first
such reply, never at load). Two distinct curves are pinned, each free for one kind of
reply and prohibitive for the other, so the drafts show which curve each reply read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.config import SamplingParams
from engine.datastore.memory import Datastore
from engine.decode import timing
from engine.decode.generate import run
from engine.decode.timing import StepCost
from engine.drafters.datastore_source import StoreDrafter
from engine.drafters.lookup import LookupDrafter
from engine.drafters.payoff import prefilled
from engine.drafters.registry import load_drafter
from tests.conftest import make_tiny_model
from tests.engine.drafters.test_composite import medusa_of, repetitive_prompt

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_new_tokens=24)
HOT = SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_new_tokens=24)
FREE, DEAR = StepCost.linear(0.0), StepCost.linear(100.0)


def pin(lm, greedy: StepCost, sampled: StepCost) -> None:
    """Both curves of `lm`, pinned instead of timed (the sampled one for HOT's settings)."""
    lm.step_costs[lm.target.name] = greedy
    lm.step_costs[timing.curve_key(lm.target.name, HOT)] = sampled


@pytest.fixture
def lm(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()  # run the full length
    return lm


def no_timing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a step-cost curve was timed")

    monkeypatch.setattr(timing, "step_seconds", refuse)


@pytest.mark.parametrize("method", ["lookup", "auto"])
def test_a_composite_plans_each_reply_by_its_own_curve(lm, method, monkeypatch):
    no_timing(monkeypatch)
    prompt = repetitive_prompt(64)
    for greedy, sampled, drafts in ((FREE, DEAR, GREEDY), (DEAR, FREE, HOT)):
        pin(lm, greedy, sampled)
        drafter = load_drafter(lm, method)
        for params in (GREEDY, HOT):
            drafted = sum(run(lm, prompt, params, drafter)[2].drafted)
            assert (drafted > 0) == (params is drafts), (method, params.temperature)


def test_building_a_drafter_times_no_sampled_curve(lm, monkeypatch):
    """Load time stays what greedy replies need: the greedy curve alone."""
    lm.step_costs[lm.target.name] = StepCost.linear(0.02)
    no_timing(monkeypatch)
    for method in ("auto", "lookup", "datastore"):
        load_drafter(lm, method)
    assert list(lm.step_costs) == [lm.target.name]


def test_lookup_fits_a_sampled_replys_chains_to_its_curve(lm):
    # ten drafts at 1.15 plain steps: short matches draft ten; at 2.2 they draft two
    cheap, dear = StepCost(((1, 1.0), (11, 1.15))), StepCost(((1, 1.0), (11, 2.2)))
    for greedy, sampled, long_for in ((cheap, dear, GREEDY), (dear, cheap, HOT)):
        pin(lm, greedy, sampled)
        drafter = LookupDrafter.timed(lm)
        for params in (GREEDY, HOT):
            session = drafter.start(SimpleNamespace(params=params), None)
            assert session.params.short_len == (10 if params is long_for else 2)


def test_the_datastore_cuts_a_sampled_replys_tree_by_its_curve(lm):
    store = Datastore("fp")
    store.add_all([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 8, 9]])
    pin(lm, FREE, DEAR)
    drafter = StoreDrafter.timed(store, lm)

    def drafted(params):
        state = SimpleNamespace(ids=[0, 2, 3, 4], room=32, params=params)
        return drafter.start(state, None).propose(state).tokens

    assert sorted(drafted(GREEDY)) == [4, 5, 6, 7, 8, 9]  # free: the whole tree
    assert drafted(HOT) == [4]  # dear: nothing pays


def test_medusa_cuts_a_sampled_replys_tree_by_its_curve(lm):
    drafter = medusa_of(lm)
    pin(lm, FREE, DEAR)
    state, session = prefilled(lm, drafter)
    assert session.propose(state).size > 1
    state.params = HOT
    assert session.propose(state).size == 1  # no cut pays: a plain step
