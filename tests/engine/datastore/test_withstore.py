"""The datastore beside the other sources: its tree grafted onto Medusa's as a trie, the
costs that decide whether it joins or drafts alone, greedy exactness of Medusa+datastore
and of Auto with the datastore on every tiny config (proving the store drafted), lossless
sampling with a broken-rule control, and the registry's rows."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine import verify
from engine.config import SamplingParams
from engine.datastore_match import Continuations
from engine.datastore_memory import Datastore, DatastoreParams
from engine.drafters.auto import COPY, KANGAROO, MEDUSA, auto
from engine.drafters.base import Draft
from engine.drafters.datastore import DatastoreDrafter
from engine.drafters.lookup import LookupParams
from engine.drafters.payoff import best_size
from engine.drafters.registry import load_drafter
from engine.drafters.withstore import (
    JOINED,
    STORE,
    TreeJoin,
    joining_pays,
    medusa_datastore,
)
from engine.errors import AcceleratorError
from engine.generate import run
from engine.timing import StepCost
from engine.tree import build_tree, join_trees, shape_of
from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.engine.drafters.medusa import test_medusa as md
from tests.engine.drafters.test_auto import drafters
from tests.engine.drafters.test_hybrid import repetitive_prompt
from tests.stats_util import chi_square_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the join and the costs ---------------------------------------------------------------


def test_the_store_tree_joins_as_a_trie():
    # a: root 9 -> (1 -> 3), 2; b: root 9 -> 1 -> 4, 1 -> 3 -> 5, 7
    a_tokens, a_children = [9, 1, 2, 3], [[1, 2], [3], [], []]
    b_tokens, b_children = [9, 1, 4, 3, 5, 7], [[1, 5], [2, 3], [], [4], [], []]
    tokens, parents, where = join_trees(a_tokens, a_children, b_tokens, b_children)
    assert tokens[:4] == a_tokens  # a's nodes and order are kept
    assert parents == [-1, 0, 0, 1, 0, 1, 3]  # 7 under the root, 4 under 1, 5 under 3
    assert [tokens[w] for w in where] == b_tokens  # every b node keeps its token
    assert where == [0, 1, 5, 3, 6, 4]  # 1 and (1, 3) were a's already
    shape = shape_of(parents)
    assert shape.children == [[1, 2, 4], [3, 5], [], [6], [], [], []]
    assert shape.depths == [0, 1, 1, 2, 1, 2, 3]
    sees = [set(torch.nonzero(row).flatten().tolist()) for row in shape.mask]
    assert sees[6] == {0, 1, 3, 6} and sees[4] == {0, 4}


def test_joining_keeps_the_first_draft_when_the_store_offers_nothing():
    join = TreeJoin()
    a = Draft.chain(9, [1, 2])
    assert join(a, Draft.chain(9, [])) == (a, [])
    joined, mine = join(a, Draft.chain(9, [1, 5]))
    assert joined.tokens == [9, 1, 2, 5] and mine == [1, 3]
    assert joined.children == [[1], [2, 3], [], []]


def test_the_store_joins_or_drafts_alone_only_where_that_pays():
    flat, steep = StepCost.linear(0.02), StepCost.linear(0.5)
    assert flat(1) == 1.0 and steep(5) == 3.0
    # a 7-token Medusa step at 1.25x; 8 store nodes expected to add half a token
    assert joining_pays(0.5, 7, 15, 1.25, flat)
    assert not joining_pays(0.5, 7, 15, 1.25, steep)
    assert not joining_pays(0.0, 7, 15, 1.0, flat)  # nothing expected: never


def test_the_step_cost_follows_the_measured_curve():
    # int4 here: steep while the kernel runs, flat once the bf16 copies take over
    cost = StepCost(((2, 1.22), (4, 1.31), (8, 1.79), (16, 2.28)))
    assert cost(1) == 1.0 and cost(2) == 1.22 and cost(16) == 2.28
    assert cost(3) == pytest.approx(1.265) and cost(12) == pytest.approx(2.035)
    assert cost(24) == pytest.approx(2.77)  # past the last point: the last segment's slope
    assert StepCost.linear(0.5)(5) == 3.0


def test_the_store_drafts_only_as_many_nodes_as_pay():
    probs = [0.9, 0.6, 0.3, 0.1, 0.05]
    flat, steep = StepCost.linear(0.01), StepCost.linear(0.4)
    alone = lambda cost: lambda k, g: (1 + g) / cost(k + 1)  # noqa: E731
    assert best_size(probs, alone(flat)) == 5  # cheap tokens: all of them
    assert best_size(probs, alone(steep)) == 2  # (1 + 1.5) / 1.8 beats 3 nodes' 2.8 / 2.2
    assert best_size(probs, alone(StepCost.linear(2.0))) == 0  # nothing pays
    assert best_size([], alone(flat)) == 0


def test_the_most_probable_nodes_form_a_tree():
    found = Continuations(tokens=[5, 6, 7, 8, 9], parents=[-1, 0, -1, 1, 2],
                          probs=[0.6, 0.6, 0.3, 0.5, 0.1], counts=[5, 5, 3, 4, 1],
                          match_len=3, expected=[0.5, 0.5, 0.3, 0.4, 0.1])
    top = found.top(3)  # 5 and its child 6 tie at 0.5: the parent comes first
    assert top.tokens == [5, 6, 8] and top.parents == [-1, 0, 1]
    assert top.expected == [0.5, 0.5, 0.4] and top.probs == [0.6, 0.6, 0.5]
    assert top.counts == [5, 5, 4] and top.match_len == 3
    assert found.top(0).tokens == [] and found.top(9) == found


def test_the_datastore_method_drafts_only_the_nodes_that_pay_when_timed():
    from types import SimpleNamespace

    store = Datastore("fp")
    store.add_all([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 8, 9]])
    state = SimpleNamespace(ids=[0, 2, 3, 4], room=32)
    untimed = DatastoreDrafter(store).propose(state)  # no cost: the whole tree
    assert sorted(untimed.tokens) == [4, 5, 6, 7, 8, 9]
    free = DatastoreDrafter(store, cost=StepCost.linear(0.0)).propose(state)
    assert free.tokens == untimed.tokens
    # 5 is kept with chance 2 / (2 + 2); 6 and 8 each with a quarter of that
    dear = DatastoreDrafter(store, cost=StepCost.linear(0.2)).propose(state)
    assert dear.tokens == [4, 5]  # (1 + 0.5) / 1.2 beats (1 + 0.625) / 1.4
    assert DatastoreDrafter(store, cost=StepCost.linear(0.5)).propose(state).tokens == [4]


# -- exactness --------------------------------------------------------------------------


def store_of(lm, prompts: list[list[int]], tokens: int = 40) -> Datastore:
    """The plain greedy replies to `prompts` and to shorter versions of them (so that some
    of the store's drafts are right and some wrong)."""
    store = Datastore("test")
    params = SamplingParams(max_new_tokens=tokens)
    store.add_all(run(lm, p, params)[1] for q in prompts for p in (q, q[3:]))
    return store


class Counting:
    """Counts how each step of a composite drafted, over every reply (a mixin)."""

    def commit(self, state, draft, path):
        self.all_steps = getattr(self, "all_steps", Counter())
        self.all_steps[self.kind] += 1
        super().commit(state, draft, path)


def counting(drafter):
    drafter.__class__ = type("Counting" + type(drafter).__name__,
                             (Counting, type(drafter)), {})
    return drafter


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_medusa_datastore_matches_plain_greedy_and_the_store_drafts(name, bundled_tokenizer):
    lm = md.small_vocab_model(bundled_tokenizer, name, 64)
    prompts = [repetitive_prompt(64), repetitive_prompt(64, seed=5)]
    store = store_of(lm, prompts)
    medusa = md.MedusaDrafter(lm, md.random_heads(lm), build_tree(md.TREE, 4))
    drafter = counting(medusa_datastore(medusa, DatastoreDrafter(store)))
    params = SamplingParams(max_new_tokens=48)
    from_store, biggest = 0, 0
    for prompt in (*prompts, [9, 8, 7, 6]):
        _t, ids, stats = run(lm, prompt, params, drafter)
        assert ids == run(lm, prompt, params)[1]
        from_store += stats.datastore_drafted
        biggest = max(biggest, *stats.drafted)
    assert drafter.all_steps[JOINED] > 0  # the store's tree was verified with the heads'
    assert from_store > 0 and biggest > len(md.TREE)


def auto_with_store(lm, arm, store, cost=None, **kw):
    m, k = drafters(lm, **kw)
    return counting(auto(arm, {"medusa": m, "kangaroo": k}, LookupParams(),
                         store=DatastoreDrafter(store), cost=cost))


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("arm", [KANGAROO, MEDUSA, "off"])
def test_auto_with_the_datastore_stays_exact_and_uses_it(name, arm, bundled_tokenizer):
    lm = make_tiny_model(name, bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    prompts = [repetitive_prompt(64), repetitive_prompt(64, seed=4)]
    a = auto_with_store(lm, arm, store_of(lm, prompts))
    params = SamplingParams(max_new_tokens=40)
    drafted = 0
    for prompt in (*prompts, [9, 8, 7, 6]):
        _t, ids, stats = run(lm, prompt, params, a)
        assert ids == run(lm, prompt, params)[1]
        drafted += stats.datastore_drafted
    assert drafted > 0
    assert a.all_steps[JOINED if arm == MEDUSA else STORE] > 0
    assert set(a.all_steps) <= {COPY, arm, JOINED, STORE}
    assert "from the datastore" in a.reason()


def test_auto_leaves_the_store_out_where_verifying_costs_too_much(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    prompts = [repetitive_prompt(64)]
    a = auto_with_store(lm, "off", store_of(lm, prompts), cost=StepCost.linear(100.0))
    run(lm, prompts[0], SamplingParams(max_new_tokens=40), a)
    assert a.all_steps[STORE] == 0 and a.all_steps["off"] > 0


# -- sampling ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampling_case(bundled_tokenizer):
    """An 8-token model, a small Medusa tree and a store offering two branches after
    every token (so the joined tree has store nodes beside and below the heads')."""
    lm = md.small_vocab_model(bundled_tokenizer, "llama-untied", 8, seed=3)
    prompt = [1, 5, 2, 6, 1, 5]
    store = Datastore("t", DatastoreParams(min_prob=0.0))
    store.add_all([[5, t, 4, 5] for t in range(8)] + [[5, t, 6, 7] for t in range(8)]
                  + [[t, 5, u] for t in range(8) for u in (2, 3)])
    medusa = md.MedusaDrafter(lm, md.random_heads(lm, seed=2), build_tree([(0,), (1,), (0, 0)], 4))
    drafter = counting(medusa_datastore(medusa, DatastoreDrafter(store), LookupParams(
        copy_len=3, short_len=3), cost=StepCost.linear(0.0)))
    return lm, prompt, drafter, md._exact_joint(lm, prompt, 3)


def test_medusa_datastore_sampling_is_lossless(sampling_case):
    lm, prompt, drafter, exact = sampling_case
    assert chi_square_pvalue(md._sampled_joint(lm, prompt, drafter, 3, md.RUNS), exact) > 1e-3
    assert drafter.all_steps[JOINED] > 0


def test_medusa_datastore_sampling_test_catches_a_broken_rule(sampling_case, monkeypatch):
    lm, prompt, drafter, exact = sampling_case
    monkeypatch.setattr(verify, "accept_pointmass", md._forgetful_pointmass)
    assert chi_square_pvalue(md._sampled_joint(lm, prompt, drafter, 3, md.RUNS), exact) < 1e-3


# -- the registry -----------------------------------------------------------------------


def test_registry_rows(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    with pytest.raises(AcceleratorError, match="train --method medusa"):
        load_drafter(lm, "medusa+datastore")
    a = load_drafter(lm, "auto")
    assert set(a.sources) == {"lookup", STORE} and a.used() == "auto:off"


def test_a_deep_node_sees_only_its_window_of_the_tree():
    """A store's deep tree on a sliding-window layer: a node's window ends inside the tree
    (position > its own - window), as it would one token at a time."""
    from engine.kv_cache import _layer_mask

    shape = shape_of([-1, 0, 1, 2, 0])  # a chain of 3 under the root and a sibling
    depths = torch.tensor(shape.depths)
    mask = _layer_mask(5, shape.mask, depths + 5, 10, 0, 2, torch.float32, torch.device("cpu"))
    sees = [set(torch.nonzero(row == 0).flatten().tolist()) for row in mask[0, 0]]
    assert sees[0] == {4, 5}  # the last cached position and itself
    assert sees[3] == {7, 8}  # depth 3 sees depth 2 and itself, not the root
    assert sees[4] == {5, 9}  # depth 1: the root and itself
