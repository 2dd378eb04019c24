"""Every drafter on the bundled SmolLM2-135M in fp32: greedy replies to three bench prompts
(three categories), 128 tokens each, equal plain greedy decoding token for token.

Kangaroo runs at exit l = 1 with a random adapter (drafts mostly rejected) and at l = 2 with
one trained on the model's own replies (briefly: enough to draft what the model says, which
exercises long accepted runs); the hybrids and Auto (with each trained arm) run with random
heads or that adapter. Every exit on every tiny config is in test_kangaroo.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from engine.config import SamplingParams
from engine.decode.chat_template import conversation, encode
from engine.decode.generate import run
from engine.decode.timing import StepCost
from engine.decode.tree import build_tree
from engine.drafters.auto import COPY, auto
from engine.drafters.composite import Composite
from engine.drafters.kangaroo import Adapter, KangarooDrafter, KangarooSettings
from engine.drafters.kangaroo_adapter import draft_head
from engine.drafters.lookup import LookupDrafter
from engine.drafters.medusa import MedusaDrafter
from tests.engine.drafters.medusa.test_medusa_bundled import TREE, _random_heads
from tests.paths import ROOT
from trainer.features import encode_conversations, hidden_states
from trainer.kangaroo.train_adapter import KangarooTrainConfig, fit_adapter
from trainer.training_loop import TrainConfig
from trainer.vocab import draft_vocabulary

pytestmark = pytest.mark.slow
BENCH = ROOT / "assets" / "bench_prompts.jsonl"
PARAMS = SamplingParams(max_new_tokens=128)
EXIT = 2  # the trained adapter's exit layer


@pytest.fixture(scope="module")
def prompts(bundled_lm):
    records = [json.loads(line) for line in BENCH.read_text().splitlines()]
    picked = records[::len(records) // 5][:3]  # one per category for the first three
    return [encode(bundled_lm.tokenizer, conversation(r["prompt"], r.get("history")))
            for r in picked]


@pytest.fixture(scope="module", autouse=True)
def pinned_costs(bundled_lm):
    """The step costs trained sources judge themselves by, pinned for this module (a flat
    CPU curve): whether they draft must not depend on what else the machine is doing."""
    costs = dict(bundled_lm.step_costs)
    bundled_lm.step_costs[bundled_lm.target.name] = StepCost.linear(0.02)
    yield
    bundled_lm.step_costs.clear()
    bundled_lm.step_costs.update(costs)


def kangaroo(lm, adapter, vocab, eta: float, tokens: float) -> KangarooDrafter:
    """`adapter` at exit EXIT measured keeping `tokens` a round, a round costing 1.2 plain
    steps (nothing timed)."""
    return KangarooDrafter(lm, adapter, KangarooSettings(EXIT, eta, 4), vocab,
                           metrics={"mean_accepted": tokens}, round_cost=1.2)


def medusa(lm, chance: float) -> MedusaDrafter:
    """Random heads over TREE, depth-d nodes measured kept with chance**d, the heads costing
    a tenth of a plain step (nothing timed)."""
    tree = build_tree(TREE, 4)
    return MedusaDrafter(lm, _random_heads(int(lm.model.config.hidden_size)), tree,
                         [chance ** len(c) for c in tree.choices[1:]], overhead=0.1)


@pytest.fixture(scope="module")
def plain(bundled_lm, prompts):
    return [run(bundled_lm, ids, PARAMS)[1] for ids in prompts]


def assert_exact(lm, prompts, plain, drafter) -> int:
    """Every reply equals plain greedy; returns the draft tokens accepted overall."""
    accepted = 0
    for ids, want in zip(prompts, plain, strict=True):
        _t, got, stats = run(lm, ids, PARAMS, drafter)
        assert got == want
        accepted += sum(stats.accepted)
    return accepted


@pytest.fixture(scope="module")
def trained_adapter(bundled_lm, prompts, plain):
    """An adapter for l = 2 fitted to the model's own greedy replies (a few epochs)."""
    lm = bundled_lm
    convs = [[{"role": "user", "content": f"Tell me about {topic}."},
              {"role": "assistant", "content": run(lm, encode(lm.tokenizer, conversation(
                  f"Tell me about {topic}.")), SamplingParams(max_new_tokens=96))[0]}]
             for topic in ("rivers", "bread", "volcanoes", "chess")]
    ids, masks = encode_conversations(lm, convs)
    feats = hidden_states(lm, ids, [EXIT, lm.model.config.num_hidden_layers], masks).load()
    vocab = draft_vocabulary(feats, 2048, lm.eos_ids, lm.model.config.vocab_size)
    head = draft_head(lm.model, vocab).float()
    torch.manual_seed(EXIT)
    adapter = Adapter.from_model(lm.model)
    fit_adapter(lm, adapter, head, vocab, (feats, feats), EXIT,
                KangarooTrainConfig(batch_tokens=2048, eval_positions=512),
                TrainConfig(lr=2e-3, epochs=4, report_every=100))
    return adapter, vocab


def test_kangaroo_random_adapter(bundled_lm, prompts, plain):
    torch.manual_seed(0)
    d = KangarooDrafter(bundled_lm, Adapter(bundled_lm.model), KangarooSettings(1, 0.0, 2))
    assert_exact(bundled_lm, prompts, plain, d)


def test_kangaroo_trained_adapter(bundled_lm, prompts, plain, trained_adapter):
    adapter, vocab = trained_adapter
    d = KangarooDrafter(bundled_lm, adapter, KangarooSettings(EXIT, 0.0, 4), vocab)
    assert assert_exact(bundled_lm, prompts, plain, d) > 0  # drafts were accepted


KANGAROO, MEDUSA = "kangaroo", "medusa"


def with_lookup(trained) -> Composite:
    return Composite(f"{trained.name}+lookup", {"lookup": LookupDrafter(), trained.name: trained},
                     lead=trained.name)


def test_kangaroo_lookup(bundled_lm, prompts, plain, trained_adapter):
    adapter, vocab = trained_adapter
    d = with_lookup(kangaroo(bundled_lm, adapter, vocab, 0.2, 2.0))
    assert assert_exact(bundled_lm, prompts, plain, d) > 0


def test_medusa(bundled_lm, prompts, plain):
    heads = _random_heads(int(bundled_lm.model.config.hidden_size))
    d = MedusaDrafter(bundled_lm, heads, build_tree(TREE, 4))
    assert assert_exact(bundled_lm, prompts, plain, d) > 0  # some tree paths were accepted


def test_medusa_lookup(bundled_lm, prompts, plain):
    d = with_lookup(medusa(bundled_lm, 0.5))
    assert assert_exact(bundled_lm, prompts, plain, d) > 0


@pytest.mark.parametrize("arm", [KANGAROO, MEDUSA])
def test_auto(bundled_lm, prompts, plain, trained_adapter, arm):
    adapter, vocab = trained_adapter
    # the arm estimated to pay, the other not (Auto leaves it out)
    rounds = kangaroo(bundled_lm, adapter, vocab, 0.2, 3.0 if arm == KANGAROO else 1.0)
    heads = medusa(bundled_lm, 0.5 if arm == MEDUSA else 0.02)
    d = auto({"lookup": LookupDrafter(), MEDUSA: heads, KANGAROO: rounds})
    steps = Counter()
    for ids, want in zip(prompts, plain, strict=True):
        _t, got, stats = run(bundled_lm, ids, PARAMS, d)
        assert got == want
        steps.update(k.split("+")[0] for k in stats.step_kinds)
    assert {COPY, arm} <= set(steps) <= {COPY, arm, "lookup", "off"}
