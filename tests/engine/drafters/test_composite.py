"""Sources composed by one rule: the offer with the most expected tokens per step cost
drafts the step, others join it where that pays; greedy exactness of Medusa+lookup and
Kangaroo+lookup on every tiny config, lossless sampling (with a broken-rule control), and
Kangaroo's caches when other sources' rounds and adapter rounds alternate."""

from __future__ import annotations

import pytest
import torch

from engine.config import SamplingParams
from engine.decode import verify
from engine.decode.drafter import Draft, DraftOffer
from engine.decode.generate import run
from engine.decode.timing import StepCost, curve_key
from engine.decode.tree import build_tree
from engine.drafters.composite import Composite, TreeJoin, best_size, pick, plan
from engine.drafters.kangaroo import Adapter, KangarooDrafter, KangarooSettings
from engine.drafters.lookup import LookupDrafter, LookupParams
from engine.drafters.medusa import MedusaDrafter
from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.engine.drafters.kangaroo import test_kangaroo as kg
from tests.engine.drafters.medusa import test_medusa as md
from tests.engine.drafters.spy import Spy
from tests.stats_util import chi_square_pvalue, whole

pytestmark = pytest.mark.usefixtures("one_thread")
# Single-token matches count as copies: a random tiny model copies no longer, and the tests
# need copy rounds and a trained source's rounds to alternate.
SINGLE = LookupParams(max_ngram=1, min_ngram=1)


def repetitive_prompt(vocab: int, seed: int = 1) -> list[int]:
    """A prompt over a small vocabulary, so n-grams recur and lookup proposes often."""
    gen = torch.Generator().manual_seed(seed)
    part = [int(t) for t in torch.randint(3, vocab, (10,), generator=gen)]
    # Ends by repeating its start: the first step already has a long match.
    return part + [int(t) for t in torch.randint(3, vocab, (8,), generator=gen)] + part[:6]


def medusa_of(lm, seed: int = 1, choices=md.TREE, chance: float = 0.7) -> MedusaDrafter:
    """Random heads over a calibrated-looking tree whose depth-d nodes were measured kept
    with chance**d, the heads costing a tenth of a plain step (nothing timed)."""
    tree = build_tree(choices, 4)
    pin_costs(lm)
    return MedusaDrafter(lm, md.random_heads(lm, seed=seed), tree,
                         [chance ** len(c) for c in tree.choices[1:]], overhead=0.1)


def kangaroo_of(lm, exit_layer: int = 2, gamma: int = 4, seed: int = 0,
                tokens: float = 2.5) -> KangarooDrafter:
    """A random adapter (eta 0: it drafts gamma tokens) measured at `tokens` per round, a
    round costing 1.2 plain steps (nothing timed)."""
    torch.manual_seed(seed)
    pin_costs(lm)
    return KangarooDrafter(lm, Adapter(lm.model), KangarooSettings(exit_layer, 0.0, gamma),
                           metrics={"mean_accepted": tokens}, round_cost=1.2)


def pin_costs(lm, cost: StepCost | None = None) -> None:
    """The step costs a trained source judges itself by, pinned (a flat CPU curve) instead
    of timed, for greedy and every kind of sampled reply alike: whether it pays must not
    depend on what else the machine is doing."""
    cost = cost or StepCost.linear(0.02)
    lm.step_costs[lm.target.name] = cost
    for top_k, top_p in ((0, 1.0), (0, 0.9), (40, 1.0), (40, 0.9)):
        hot = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
        lm.step_costs[curve_key(lm.target.name, hot)] = cost


def with_lookup(trained, lookup: LookupParams | None = None, cost=None) -> Spy:
    """`trained` with lookup, as the registry composes "<name>+lookup"."""
    return Spy(Composite(f"{trained.name}+lookup", {"lookup": LookupDrafter(lookup),
                                                    trained.name: trained},
                         cost, lead=trained.name))


def break_pointmass(monkeypatch) -> None:
    """Replace point-mass acceptance with a broken rule: it accepts a draft token with
    probability ~sqrt(p) instead of p (a sampling test must reject it)."""
    fair = verify.accept_pointmass

    def eager(children, tokens, target_probs, generator):
        flat = whole(target_probs, len(tokens)).sqrt()
        return fair(children, tokens, flat / flat.sum(-1, keepdim=True), generator)

    monkeypatch.setattr(verify, "accept_pointmass", eager)


# -- the rule -----------------------------------------------------------------------------


def chain_offer(kind, tokens, chances, overhead=0.0, round_cost=None, joins=True) -> DraftOffer:
    chances = list(chances)
    return DraftOffer(kind, lambda k: Draft.chain(0, tokens[:k], chances=chances[:k]),
                      tuple(chances), overhead, round_cost, joins)


def test_the_step_takes_the_most_tokens_per_step_cost_or_plain_decoding():
    flat = StepCost.linear(0.02)
    trained = chain_offer("trained", [1, 2, 3], (0.5, 0.4, 0.3), round_cost=1.5)  # 2.2 / 1.5
    likely = chain_offer("likely", [4, 5], chances=(0.9, 0.8))  # 2.7 tokens / 1.04
    unlikely = chain_offer("unlikely", [6], chances=(0.01,))
    assert pick([trained, unlikely], flat) == (0, 3)
    assert pick([trained, likely], flat) == (1, 2)
    assert pick([unlikely, None], flat) is None  # nothing beats one token per plain step
    assert pick([chain_offer("slow", [1], (0.5,), round_cost=1.6)], flat) is None


def test_a_sources_own_work_is_priced_in():
    flat = StepCost.linear(0.02)
    heads = chain_offer("heads", [1, 2], (0.3, 0.1), overhead=0.3)  # 1.4 / 1.34: pays
    assert pick([heads], flat) == (0, 2)
    dear = chain_offer("heads", [1, 2], (0.3, 0.1), overhead=0.5)  # 1.4 / 1.54: does not
    assert pick([dear], flat) is None


def test_nodes_are_cut_to_those_that_pay():
    steep = StepCost.linear(0.4)
    offer = chain_offer("c", [1, 2, 3, 4], chances=(0.9, 0.6, 0.3, 0.1))
    assert pick([offer], steep) == (0, 2)  # (1 + 1.5) / 1.8 beats 3 nodes' 2.8 / 2.2
    assert best_size([0.9, 0.6, 0.3, 0.1, 0.05], lambda k, g: (1 + g) / steep(k + 1)) == 2
    assert best_size([], lambda k, g: (1 + g) / steep(k + 1)) == 0


def test_offers_join_where_that_pays_and_a_copy_is_verified_alone():
    tree = chain_offer("medusa", [1, 2], (0.6, 0.4))
    short = chain_offer("lookup", [7], chances=(0.3,))
    flat, steep = StepCost.linear(0.01), StepCost.linear(0.5)
    step = plan([tree, short], 0, flat, TreeJoin(), [False, False])
    assert step.kind == "medusa+lookup" and step.draft.tokens == [0, 1, 2, 7]
    assert step.nodes_by_source == {0: [1, 2], 1: [3]}
    assert plan([tree, short], 0, steep, TreeJoin(), [False, False]).kind == "medusa"
    copy = chain_offer("copy", [5, 6, 7], chances=(0.9, 0.9, 0.9), joins=False)
    step = plan([copy, tree], 0, flat, TreeJoin(), [False, False])
    assert step.kind == "copy" and step.draft.tokens == [0, 5, 6, 7]
    own = plan([tree], 0, flat, TreeJoin(), [True])
    assert own.verifier == 0  # a source that verifies its own drafts gets the step
    assert plan([], 0, flat, TreeJoin(), []).kind == "off"


def test_a_node_two_sources_offer_counts_once():
    """Lookup's chain repeats the heads' top path: grafted, it merges into nodes already
    there, adds nothing, and is not joined (counting it twice would join it)."""
    flat = StepCost.linear(0.01)
    tree = chain_offer("medusa", [1, 2], (0.7, 0.6))
    same = chain_offer("lookup", [1, 2], (0.5, 0.3))
    step = plan([tree, same], 0, flat, TreeJoin(), [False, False])
    assert step.kind == "medusa" and step.draft.tokens == [0, 1, 2]
    longer = chain_offer("lookup", [1, 2, 3], (0.5, 0.4, 0.35))  # a third token is new
    step = plan([tree, longer], 0, flat, TreeJoin(), [False, False])
    assert step.kind == "medusa+lookup" and step.draft.tokens == [0, 1, 2, 3]
    assert step.draft.chances == pytest.approx([1.0, 0.7, 0.6, 0.35])


def test_an_offer_whose_join_cannot_pay_is_never_built():
    """Heads dearer than any tokens they could add are not run to find that out: every
    build of a trained source's offer runs its heads."""
    flat = StepCost.linear(0.02)
    store = chain_offer("datastore", [1, 2, 3], (0.9, 0.8, 0.7))
    built = []
    dear = DraftOffer("medusa", lambda k: built.append(k) or Draft.chain(0, [4][:k], chances=[0.3]),
                      (0.3,), overhead=0.5)  # at most 0.3 more tokens for half a step more
    assert plan([store, dear], 0, flat, TreeJoin(), [False, False]).kind == "datastore"
    assert built == []
    cheap = DraftOffer("medusa",
                       lambda k: built.append(k) or Draft.chain(0, [4][:k], chances=[0.3]),
                       (0.3,), overhead=0.0)
    assert plan([store, cheap], 0, flat, TreeJoin(), [False, False]).kind == "datastore+medusa"
    assert built == [1]


def test_a_copy_in_progress_wins_over_a_trained_tree():
    """A copy whose continuations this reply kept beats the heads' usual tree."""
    cost = StepCost(((1, 1.0), (4, 1.1), (11, 1.6)))
    copy = chain_offer("copy", list(range(1, 11)), [0.95 ** i for i in range(1, 11)],
                       joins=False)
    tree = chain_offer("medusa", [20, 21, 22], (0.6, 0.35, 0.2), overhead=0.15)
    assert plan([tree, copy], 0, cost, TreeJoin(), [False, False]).kind == "copy"


# -- Medusa + lookup ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_medusa_lookup_matches_plain_greedy(name, bundled_tokenizer):
    lm = md.small_vocab_model(bundled_tokenizer, name, 64)
    prompt, params = repetitive_prompt(64), SamplingParams(max_new_tokens=48)
    drafter = with_lookup(medusa_of(lm))
    _t, ids, stats = run(lm, prompt, params, drafter)
    assert ids == run(lm, prompt, params)[1]
    assert stats.step_kinds.get("medusa+lookup", 0) > 0  # a lookup branch joined the tree


def test_medusa_lookup_without_a_tree_drafts_from_lookup_alone(bundled_tokenizer):
    lm = md.small_vocab_model(bundled_tokenizer, "llama-gqa", 64)
    prompt, params = repetitive_prompt(64), SamplingParams(max_new_tokens=40)
    drafter = with_lookup(medusa_of(lm, choices=[]), LookupParams())
    # priced out here: it leaves the mix (no layer states kept for it), its verdict stays
    assert list(drafter.sources) == ["lookup"] and not drafter.wants_hidden
    assert not drafter.pays_off
    _t, ids, stats = run(lm, prompt, params, drafter)
    assert ids == run(lm, prompt, params)[1]
    kinds = stats.step_kinds
    assert set(kinds) <= {"copy", "lookup", "off"} and kinds.get("copy", 0) + kinds["lookup"]


@pytest.fixture(scope="module")
def medusa_sampling_case(bundled_tokenizer):
    """An 8-token model, a small tree and a prompt whose suffix recurs (lookup drafts)."""
    lm = md.small_vocab_model(bundled_tokenizer, "llama-untied", 8, seed=3)
    prompt = [1, 5, 2, 6, 1, 5]
    drafter = with_lookup(medusa_of(lm, seed=2, choices=[(0,), (1,), (0, 0)]),
                          LookupParams(copy_len=3, short_len=3), StepCost.linear(0.0))
    return lm, prompt, drafter, md._exact_joint(lm, prompt, 3)


def test_medusa_lookup_sampling_is_lossless(medusa_sampling_case):
    lm, prompt, drafter, exact = medusa_sampling_case
    assert chi_square_pvalue(md._sampled_joint(lm, prompt, drafter, 3, md.RUNS), exact) > 1e-3
    assert drafter.steps["medusa+lookup"] > 0


def test_medusa_lookup_sampling_test_catches_a_broken_rule(medusa_sampling_case, monkeypatch):
    lm, prompt, drafter, exact = medusa_sampling_case
    monkeypatch.setattr(verify, "accept_pointmass", md._forgetful_pointmass)
    assert chi_square_pvalue(md._sampled_joint(lm, prompt, drafter, 3, md.RUNS), exact) < 1e-3


# -- Kangaroo + lookup -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("exit_layer", [1, 2, 3])
def test_kangaroo_lookup_matches_plain_greedy(name, exit_layer, bundled_tokenizer):
    lm = make_tiny_model(name, bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    prompt, params = repetitive_prompt(64), SamplingParams(max_new_tokens=48)
    d = with_lookup(kangaroo_of(lm, exit_layer), SINGLE)
    _t, ids, stats = run(lm, prompt, params, d)
    assert ids == run(lm, prompt, params)[1]
    assert stats.step_kinds["copy"] > 0 and stats.step_kinds["kangaroo"] > 0


def test_kangaroo_lookup_caches_stay_consistent(bundled_tokenizer, monkeypatch):
    lm = make_tiny_model("qwen2", bundled_tokenizer, vocab_size=12)  # tokens recur often
    lm.eos_ids = ()
    k = kangaroo_of(lm)
    d = kg.recording(with_lookup(k, SINGLE), k)
    kept = kg.check_caches_after_random_accepts(lm, d, [5, 6, 7, 8, 9] * 3, monkeypatch)
    assert d.inner.steps["copy"] > 0 and max(kept) > 1  # copies left states for the adapter


def test_kangaroo_lookup_when_kangaroo_does_not_pay_is_lookup(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    prompt, params = repetitive_prompt(64), SamplingParams(max_new_tokens=40)
    d = with_lookup(kangaroo_of(lm, gamma=0), SINGLE)  # gamma 0: calibration found no gain
    _t, ids, stats = run(lm, prompt, params, d)
    assert ids == run(lm, prompt, params)[1]
    assert "kangaroo" not in stats.step_kinds and stats.step_kinds["copy"] > 0


def test_kangaroo_lookup_sampling_is_lossless_and_catches_a_broken_rule(
        bundled_tokenizer, monkeypatch):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=kg.VOCAB, num_layers=3)
    lm.eos_ids = ()
    prompt = [1, 4, 2, 5, 1, 4]  # 4 recurs: the first round copies
    d = with_lookup(kangaroo_of(lm, exit_layer=1, gamma=3, seed=3), SINGLE)
    exact = kg._exact_joint(lm, prompt)
    assert chi_square_pvalue(kg._sampled_joint(lm, prompt, d, 800), exact) > 1e-3
    assert d.steps["copy"] > 0 and d.steps["kangaroo"] > 0
    break_pointmass(monkeypatch)
    assert chi_square_pvalue(kg._sampled_joint(lm, prompt, d, 800), exact) < 1e-3

