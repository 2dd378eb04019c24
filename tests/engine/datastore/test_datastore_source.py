"""The datastore beside the other sources: its tree grafted onto another as a trie, cut to
the nodes that pay, greedy exactness of Medusa+datastore and of Auto with the datastore on
every tiny config (proving the store drafted), lossless sampling with a broken-rule
control, and the registry's rows."""

from __future__ import annotations

import pytest
import torch

from engine.config import SamplingParams
from engine.datastore.match import Continuations
from engine.datastore.memory import Datastore
from engine.datastore.params import DatastoreParams
from engine.decode import verify
from engine.decode.drafter import Draft
from engine.decode.generate import run
from engine.decode.timing import StepCost
from engine.decode.tree import join_trees, shape_of
from engine.drafters.auto import COPY, auto
from engine.drafters.composite import Composite, TreeJoin, plan
from engine.drafters.datastore_source import StoreDrafter
from engine.drafters.lookup import LookupDrafter, LookupParams
from engine.drafters.registry import ACCEL_LABELS, load_drafter
from engine.errors import AcceleratorError
from tests.conftest import TINY_CONFIGS, make_tiny_model
from tests.engine.drafters.medusa import test_medusa as md
from tests.engine.drafters.spy import Spy
from tests.engine.drafters.test_composite import (
    kangaroo_of,
    medusa_of,
    repetitive_prompt,
)
from tests.stats_util import chi_square_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")
STORE = "datastore"


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


def test_the_store_joins_a_tree_only_where_its_nodes_pay():
    store = Datastore("fp")
    store.add_all([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 8, 9]])
    from types import SimpleNamespace

    state = SimpleNamespace(ids=[0, 2, 3, 4], room=32, params=SamplingParams())
    offer = StoreDrafter(store).start(state, None).offer(state)
    tree = Draft.chain(4, [7, 7], chances=[0.9, 0.8])  # a 2-node trained draft
    from engine.decode.drafter import DraftOffer

    trained = DraftOffer("medusa", lambda k: tree, (0.9, 0.8))
    flat, steep = StepCost.linear(0.02), StepCost.linear(0.5)
    assert plan([trained, offer], 4, flat, TreeJoin(), [False, False]).kind == "medusa+datastore"
    assert plan([trained, offer], 4, steep, TreeJoin(), [False, False]).kind == "medusa"


def test_the_step_cost_follows_the_measured_curve():
    # int4 here: steep while the kernel runs, flat once the bf16 copies take over
    cost = StepCost(((2, 1.22), (4, 1.31), (8, 1.79), (16, 2.28)))
    assert cost(1) == 1.0 and cost(2) == 1.22 and cost(16) == 2.28
    assert cost(3) == pytest.approx(1.265) and cost(12) == pytest.approx(2.035)
    assert cost(24) == pytest.approx(2.77)  # past the last point: the last segment's slope
    assert StepCost.linear(0.5)(5) == 3.0


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
    state = SimpleNamespace(ids=[0, 2, 3, 4], room=32, params=SamplingParams())

    def drafted(cost):
        return StoreDrafter(store, cost).start(state, None).propose(state).tokens

    assert sorted(drafted(StepCost.linear(0.0))) == [4, 5, 6, 7, 8, 9]  # free: the whole tree
    # 5 is kept with chance 2 / (2 + 2); 6 and 8 each with a quarter of that
    assert drafted(StepCost.linear(0.2)) == [4, 5]  # (1 + 0.5) / 1.2 beats (1 + 0.625) / 1.4
    assert drafted(StepCost.linear(0.5)) == [4]


def test_a_step_the_store_does_not_draft_counts_no_drafted_tokens():
    """Drafting alone, a plain step after a drafted one adds nothing to the drafted count
    (the earlier step's nodes are not counted twice)."""
    from types import SimpleNamespace

    from engine.decode.stats import GenerationStats

    store = Datastore("fp")
    store.add_all([[1, 2, 3, 4, 5]])
    target = SimpleNamespace(keep_path=lambda *args: None)
    drafted = SimpleNamespace(ids=[0, 2, 3], room=32, params=SamplingParams(), target=target,
                              cache=None, cached=2)
    session = StoreDrafter(store, StepCost.linear(0.0)).start(drafted, None)
    draft = session.propose(drafted)
    assert draft.tokens[1:] == [4, 5]
    session.commit(drafted, draft, [1])
    plain = SimpleNamespace(**{**vars(drafted), "ids": [0, 9, 9]})
    empty = session.propose(plain)
    assert empty.size == 1
    session.commit(plain, empty, [])
    stats = GenerationStats()
    session.finish(stats)
    assert (stats.datastore_drafted, stats.datastore_accepted) == (2, 1)


# -- exactness --------------------------------------------------------------------------


def store_of(lm, prompts: list[list[int]], tokens: int = 40) -> Datastore:
    """The plain greedy replies to `prompts` and to shorter versions of them (so that some
    of the store's drafts are right and some wrong)."""
    store = Datastore("test")
    params = SamplingParams(max_new_tokens=tokens)
    store.add_all(run(lm, p, params)[1] for q in prompts for p in (q, q[3:]))
    return store


def medusa_datastore(lm, store: Datastore, lookup=None, cost=None, seed=1,
                     choices=md.TREE) -> Spy:
    """Medusa+datastore as the registry composes it."""
    return Spy(Composite("medusa+datastore", {
        "lookup": LookupDrafter(lookup), "medusa": medusa_of(lm, seed, choices),
        STORE: StoreDrafter(store, cost)}, cost, lead="medusa"))


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_medusa_datastore_matches_plain_greedy_and_the_store_drafts(name, bundled_tokenizer):
    lm = md.small_vocab_model(bundled_tokenizer, name, 64)
    prompts = [repetitive_prompt(64), repetitive_prompt(64, seed=5)]
    store = store_of(lm, prompts)
    drafter = medusa_datastore(lm, store)
    params = SamplingParams(max_new_tokens=48)
    from_store, biggest = 0, 0
    for prompt in (*prompts, [9, 8, 7, 6]):
        _t, ids, stats = run(lm, prompt, params, drafter)
        assert ids == run(lm, prompt, params)[1]
        from_store += stats.datastore_drafted
        biggest = max(biggest, *stats.drafted)
    assert any("datastore" in k for k in drafter.steps)  # verified with the heads' tree
    assert from_store > 0 and biggest > len(md.TREE)


def auto_with_store(lm, best, store, cost=None) -> Spy:
    """Auto over lookup, the store and `best` (a random trained source at 1.5x; "off":
    none)."""
    trained = {"medusa": lambda: medusa_of(lm), "kangaroo": lambda: kangaroo_of(lm)}
    sources = {"lookup": LookupDrafter(LookupParams())}
    if best != "off":
        sources[best] = trained[best]()
    sources[STORE] = StoreDrafter(store, cost)
    return Spy(auto(sources, cost, ACCEL_LABELS))


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("arm", ["kangaroo", "medusa", "off"])
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
    assert any(STORE in k for k in a.steps)
    assert {k.split("+")[0] for k in a.steps} <= {COPY, "lookup", arm, STORE, "off"}
    assert "from the datastore" in a.reason()


def test_auto_leaves_the_store_out_where_verifying_costs_too_much(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=64)
    lm.eos_ids = ()
    prompts = [repetitive_prompt(64)]
    a = auto_with_store(lm, "off", store_of(lm, prompts), cost=StepCost.linear(100.0))
    run(lm, prompts[0], SamplingParams(max_new_tokens=40), a)
    assert not any(STORE in k for k in a.steps) and a.steps["off"] > 0


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
    drafter = medusa_datastore(lm, store, LookupParams(copy_len=3, short_len=3),
                               StepCost.linear(0.0), seed=2, choices=[(0,), (1,), (0, 0)])
    return lm, prompt, drafter, md._exact_joint(lm, prompt, 3)


def test_medusa_datastore_sampling_is_lossless(sampling_case):
    lm, prompt, drafter, exact = sampling_case
    assert chi_square_pvalue(md._sampled_joint(lm, prompt, drafter, 3, md.RUNS), exact) > 1e-3
    assert any("datastore" in k and "medusa" in k for k in drafter.steps)


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
    assert set(a.sources) == {"lookup", STORE, "grammar"} and a.used() == "auto:off"


def test_a_deep_node_sees_only_its_window_of_the_tree():
    """A store's deep tree on a sliding-window layer: a node's window ends inside the tree
    (position > its own - window), as it would one token at a time."""
    from engine.decode.kv_cache import _layer_mask

    shape = shape_of([-1, 0, 1, 2, 0])  # a chain of 3 under the root and a sibling
    depths = torch.tensor(shape.depths)
    mask = _layer_mask(5, shape.mask, depths + 5, 10, 0, 2, torch.float32, torch.device("cpu"))
    sees = [set(torch.nonzero(row == 0).flatten().tolist()) for row in mask[0, 0]]
    assert sees[0] == {4, 5}  # the last cached position and itself
    assert sees[3] == {7, 8}  # depth 3 sees depth 2 and itself, not the root
    assert sees[4] == {5, 9}  # depth 1: the root and itself
