"""A reply's logit bias, penalties and grammar, applied at every verified position: the pure
math on hand-made logits, greedy replies equal to plain decoding with every drafter, and
sampled replies distributed as plain decoding's under the same rules."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.config import SamplingParams
from engine.datastore.memory import Datastore
from engine.decode import grammar as grammars
from engine.decode.generate import run
from engine.decode.logit_rules import LogitRules, node_paths
from engine.decode.sampling import logits_to_probs, top_logprobs
from engine.decode.timing import StepCost
from engine.drafters.composite import Composite
from engine.drafters.datastore_source import StoreDrafter
from engine.drafters.grammar_source import GrammarDrafter
from engine.drafters.lookup import LookupDrafter, LookupParams
from engine.errors import QuickdraftError
from tests.conftest import make_tiny_model
from tests.engine.decode.toy_grammar import ToyGrammar
from tests.engine.drafters.medusa import test_medusa as md
from tests.engine.drafters.test_composite import kangaroo_of, medusa_of, repetitive_prompt
from tests.engine.drafters.toy_source import ToyDrafter
from tests.stats_util import chi_square_pvalue

pytestmark = pytest.mark.usefixtures("one_thread")
PENALISED = dict(presence_penalty=0.8, frequency_penalty=0.5, logit_bias=((5, 1.5), (7, -3.0)))


def reference_row(logits: torch.Tensor, reply: list[int], params: SamplingParams,
                  allowed: set[int] | None = None) -> torch.Tensor:
    """OpenAI's definition, token by token: bias, then each token's count in the reply."""
    out = logits.double().clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    for token in set(reply):
        out[token] -= params.frequency_penalty * reply.count(token) + params.presence_penalty
    if allowed is not None:
        out[[t for t in range(len(out)) if t not in allowed]] = -math.inf
    return out


def test_each_row_of_a_tree_is_penalised_as_plain_decoding_would_after_its_node():
    params = SamplingParams(**PENALISED)
    rules = LogitRules(params, 12, torch.device("cpu"))
    reply = [5, 3, 5]  # the last one is the pending token, the draft's root
    rules.advance(reply)
    children, tokens = [[1, 2], [3], [], [4], []], [5, 5, 7, 3, 5]  # a tree under the root
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(0))
    shaped = rules.shape(logits, children, tokens)
    for node, path in enumerate(node_paths(children, tokens)):
        want = reference_row(logits[node], reply + path, params)
        assert torch.allclose(shaped[node].double(), want, atol=1e-5), node
    assert node_paths(children, tokens) == [[], [5], [7], [5, 3], [5, 3, 5]]


def test_a_grammar_masks_each_row_after_its_node_and_leaves_refused_branches_alone():
    toy = ToyGrammar([{3, 4}, {5, 6}, {7}])
    rules = LogitRules(SamplingParams(), 12, torch.device("cpu"), toy.start(None))
    rules.advance([3])  # the pending token: position 1 comes next
    children, tokens = [[1, 2], [3], [], []], [3, 6, 9, 7]  # 9 is refused at position 1
    logits = torch.zeros(4, 12)
    shaped = rules.shape(logits, children, tokens)
    assert torch.isfinite(shaped[0]).tolist() == [t in (5, 6) for t in range(12)]
    assert torch.isfinite(shaped[1]).tolist() == [t == 7 for t in range(12)]
    assert torch.isfinite(shaped[2]).all()  # unreachable: its parent's row refuses 9
    assert torch.isfinite(shaped[3]).tolist() == [t in (3, 4) for t in range(12)]
    assert rules.forced() == []  # position 1 has a choice
    rules.advance([6])
    assert rules.forced() == [7]


def test_top_p_zero_keeps_the_top_token_and_tiny_temperatures_stay_finite():
    logits = torch.tensor([1.0, 3.0, 2.0, 2.9])
    assert logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.0)).tolist() == \
        [0.0, 1.0, 0.0, 0.0]
    probs = logits_to_probs(logits * 1e30, SamplingParams(temperature=1e-30))
    assert torch.isfinite(probs).all() and probs.argmax() == 1


def test_logprobs_are_the_log_softmax_of_the_shaped_row():
    logits = torch.tensor([[0.0, 1.0, 2.0, -math.inf], [2.0, 0.0, 0.0, 0.0]])
    out = top_logprobs(logits, [1, 0], 2)
    logp = torch.log_softmax(logits, -1)
    assert out[0][0] == pytest.approx(float(logp[0, 1]))
    assert [t for t, _ in out[0][1]] == [2, 1] and [t for t, _ in out[1][1]][0] == 0


def test_an_invalid_schema_is_refused_in_one_line(bundled_tokenizer):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=1)
    with pytest.raises(QuickdraftError, match="JSON schema"):
        grammars.check(lm, grammars.json_schema({"type": "object", "properties": 5}, "bad"))
    with pytest.raises(QuickdraftError, match="must be an object"):
        grammars.json_schema([1, 2])


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "size": {"enum": ["small", "medium", "large"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "size", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def wide(bundled_tokenizer):
    """A tiny model over the bundled tokenizer's whole vocabulary (JSON needs its tokens)."""
    return make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=2)


def drafters(lm, script: list[int]) -> dict:
    """Every kind of source, and Auto's rule over all of them (random trained ones; a toy
    that knows the reply, `script`, so long drafts are verified and kept)."""
    store = Datastore("test")
    store.add_all([run(lm, repetitive_prompt(300, seed=s), SamplingParams(max_new_tokens=24))[1]
                   for s in (2, 3)])
    sources = {"lookup": LookupDrafter(LookupParams(max_ngram=2)), "medusa": medusa_of(lm),
               "kangaroo": kangaroo_of(lm, exit_layer=1), "datastore": StoreDrafter(store),
               "grammar": GrammarDrafter(), "toy": ToyDrafter(script, 0.9)}
    cheap = StepCost()  # drafts always pay: every source's offers are verified
    return {**sources, "auto": Composite("auto", dict(sources), cheap)}


@pytest.mark.parametrize("shaping", ["penalties", "json_schema"])
def test_greedy_replies_under_rules_equal_plain_decoding_with_every_drafter(wide, shaping):
    params = SamplingParams(max_new_tokens=60, **(PENALISED if shaping == "penalties" else {}))
    grammar = grammars.json_schema(SCHEMA, "item") if shaping == "json_schema" else None
    prompt = repetitive_prompt(300)
    _t, plain, _s = run(wide, prompt, params, grammar=grammar)
    if grammar is not None:  # a random model, held to the schema
        text = wide.tokenizer.decode(plain, skip_special_tokens=True)
        assert set(json.loads(text)) == {"name", "size", "count"}
    kept = {}
    for name, drafter in drafters(wide, plain).items():
        _t, ids, stats = run(wide, prompt, params, drafter, grammar=grammar)
        assert ids == plain, name
        kept[name] = sum(stats.accepted)
    if grammar is not None:
        assert kept["grammar"] >= 6  # the keys and separators were drafted and kept
    assert kept["toy"] > len(plain) // 2 and kept["auto"] > len(plain) // 2


VOCAB = 12
STATS_PATTERN = [{3, 4, 5, 6, 7, 8}, {4, 5, 6, 7, 8, 9, 10}, {3, 5, 7, 9, 11}]
PROMPT = [1, 5, 2]


def exact_joint(lm, params: SamplingParams, toy: ToyGrammar) -> torch.Tensor:
    """P(first three tokens) under the rules, enumerated from the model and the reference
    definition (no engine code): (VOCAB ** 3,)."""
    grid = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # (V^2, 2)
    seqs = torch.cat([torch.tensor(PROMPT).expand(len(grid), -1), grid], dim=1)
    with torch.inference_mode():
        logits = lm.model(input_ids=seqs).logits.double()  # (V^2, P + 2, V)
    n = len(PROMPT)

    def p(prefix: list[int]) -> torch.Tensor:  # the shaped next-token distribution
        row = 0 if not prefix else (prefix[0] * VOCAB + (prefix[1] if len(prefix) > 1 else 0))
        raw = logits[row, n - 1 + len(prefix)]
        return torch.softmax(reference_row(raw, prefix, params, toy.pattern[len(prefix)]), -1)

    probs = torch.zeros(VOCAB ** 3, dtype=torch.float64)
    first = p([])
    for x1 in range(VOCAB):
        second = p([x1])
        for x2 in range(VOCAB):
            probs[(x1 * VOCAB + x2) * VOCAB:(x1 * VOCAB + x2 + 1) * VOCAB] = \
                first[x1] * second[x2] * p([x1, x2])
    return probs


def sampled_joint(lm, params: SamplingParams, drafter, toy: ToyGrammar, runs: int):
    counts = torch.zeros(VOCAB ** 3, dtype=torch.long)
    for seed in range(runs):
        p = SamplingParams(temperature=1.0, max_new_tokens=3, seed=seed, **PENALISED)
        ids = run(lm, PROMPT, p, drafter, grammar=toy)[1]
        counts[(ids[0] * VOCAB + ids[1]) * VOCAB + ids[2]] += 1
    return counts


@pytest.fixture(scope="module")
def sampling_case(bundled_tokenizer):
    lm = md.small_vocab_model(bundled_tokenizer, "llama-untied", VOCAB, seed=3)
    toy = ToyGrammar(STATS_PATTERN)
    params = SamplingParams(temperature=1.0, **PENALISED)
    return lm, toy, exact_joint(lm, params, toy)


RUNS = 1500


@pytest.mark.parametrize("kind", ["medusa", "kangaroo"])
def test_sampling_under_rules_is_lossless_and_the_test_catches_rows_left_unshaped(
        sampling_case, kind, monkeypatch):
    """Medusa's tree (point-mass proposals) and Kangaroo's chain (drafted from q) keep the
    penalised, masked distribution; shaping only the first row of each draft breaks it."""
    lm, toy, exact = sampling_case
    drafter = (md.medusa(lm, md.random_heads(lm, seed=2), [(0,), (1,), (2,), (0, 0), (1, 0)])
               if kind == "medusa" else kangaroo_of(lm, exit_layer=1, gamma=2))
    params = SamplingParams(temperature=1.0, **PENALISED)
    assert chi_square_pvalue(sampled_joint(lm, params, drafter, toy, RUNS), exact) > 1e-3

    shape = LogitRules.shape

    def first_row_only(self, logits, children, tokens):
        out = logits.float().clone()
        out[0] = shape(self, logits[:1], [[]], tokens[:1])[0]
        return out

    monkeypatch.setattr(LogitRules, "shape", first_row_only)
    assert chi_square_pvalue(sampled_joint(lm, params, drafter, toy, RUNS), exact) < 1e-3
