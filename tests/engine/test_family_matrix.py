"""Every drafter on every kind of model the engine meets: greedy output identical to plain
decoding, and the cache after a reply identical to one-by-one decoding.

Tiny random models (built here) cover what the bundled Llama does not: grouped-query
attention, an untied head, a sliding window shorter than the reply (Mistral), alternating
sliding / full layers with logit soft-capping (Gemma-2), learned absolute positions with a
short context (GPT-2), and q/k norms (Qwen3). For each, three replies: one that runs to
the last position of the context window, one cut by a stop string, and one whose prompt
makes lookup fire. The vocabulary is the bundled tokenizer's first 100 ids (single
characters from id 17 on), so replies repeat themselves and stop strings are real text.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from engine.config import ModelSpec, SamplingParams
from engine.datastore.memory import Datastore
from engine.decode.generate import run
from engine.decode.tree import build_tree
from engine.drafters.datastore_source import StoreDrafter
from engine.drafters.grammar_source import GrammarDrafter
from engine.drafters.lookup import LookupDrafter
from engine.drafters.registry import compose
from engine.errors import AcceleratorError
from engine.model.loading import wrap_model
from tests.cache_util import held
from tests.engine.drafters.test_composite import kangaroo_of, medusa_of, pin_costs

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 100
CONTEXT = 64
# scripts/gpu_check.py runs this module on CUDA; the suite runs it on the CPU.
DEVICE = torch.device(os.environ.get("QUICKDRAFT_TEST_DEVICE", "cpu"))
LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=CONTEXT)
FAMILIES = {
    "llama-gqa": ("llama", LLAMA_LIKE),
    "qwen2-untied": ("qwen2", {**LLAMA_LIKE, "tie_word_embeddings": False}),
    "mistral-sliding": ("mistral", {**LLAMA_LIKE, "sliding_window": 8}),
    "gemma2-alternating": ("gemma2", {**LLAMA_LIKE, "sliding_window": 8, "head_dim": 16,
                                      "query_pre_attn_scalar": 16,
                                      "final_logit_softcapping": 30.0,
                                      "attn_logit_softcapping": 50.0}),
    "gpt2-absolute": ("gpt2", dict(n_embd=64, n_inner=128, n_layer=4, n_head=4,
                                   n_positions=CONTEXT)),
    "qwen3-qknorm": ("qwen3", {**LLAMA_LIKE, "head_dim": 16}),
}
METHODS = ("lookup", "datastore", "medusa", "medusa+lookup", "medusa+datastore", "kangaroo",
           "kangaroo+lookup", "auto")


def family_model(name: str, tokenizer):
    model_type, extra = FAMILIES[name]
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, initializer_range=0.2,
                                  eos_token_id=tokenizer.eos_token_id, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(DEVICE)
    lm = wrap_model(model, tokenizer, ModelSpec(source=name), name, "fp32")
    return dataclasses.replace(lm, eos_ids=())  # replies run to their budget


def make_drafter(lm, method: str):
    """The method as the registry composes it over random heads and a random adapter (eta 0:
    it drafts 4 tokens), both estimated to pay a little (the step costs pinned), so the
    store's and lookup's drafts win steps too; the adapter's interplay with other sources'
    rounds is the most involved (it reads the states of their tokens at its next round)."""
    pin_costs(lm)  # whether a source drafts must not depend on what the machine is doing
    built = {
        "lookup": LookupDrafter,
        "grammar": GrammarDrafter,
        "datastore": lambda: StoreDrafter(family_store(lm)),
        "medusa": lambda: medusa_of(lm, chance=0.3),
        "kangaroo": lambda: kangaroo_of(lm, 2, 4, tokens=1.5),
    }
    return compose(lm, method, lambda name: built[name]())


def family_store(lm) -> Datastore:
    """The prompts and earlier replies to them (and to a shorter version of each, so that
    some drafts are wrong)."""
    store = Datastore("test")
    asked = [*prompts().values(), *(p[2:] for p in prompts().values())]
    store.add_all([*prompts().values(), *(run(lm, p, SamplingParams(max_new_tokens=24))[1]
                                          for p in asked)])
    return store


def drafter_or_skip(name: str, lm, method: str):
    """The drafter, or a skip naming the refusal (Kangaroo's layer split: Llama-layout
    families only), after checking the refusal is the expected one."""
    try:
        return make_drafter(lm, method)
    except AcceleratorError as exc:
        assert "not supported for this architecture" in str(exc)
        assert name in ("gemma2-alternating", "gpt2-absolute")
        pytest.skip(f"{method} refuses {name}: {exc}")


def capture_state(monkeypatch) -> list:
    """The decode state of each generation, to read its cache afterwards."""
    from engine.decode import generate

    states, prefill = [], generate._prefill

    def recording(*args):
        state, *rest = prefill(*args)
        states.append(state)
        return state, *rest

    monkeypatch.setattr(generate, "_prefill", recording)
    return states


def one_by_one_cache(lm, ids: list[int]) -> DynamicCache:
    """transformers' own cache after feeding `ids` one token at a time."""
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        for t in ids:
            lm.model(input_ids=torch.tensor([[t]], device=DEVICE), cache=cache, use_cache=True)
    return cache


def assert_same_cache(got, want: DynamicCache, length: int) -> None:
    for (k, v), (wk, wv) in zip(held(got, length), held(want, length), strict=True):
        # A sliding layer keeps at least its window; compare what both hold.
        n = min(k.shape[-2], wk.shape[-2])
        assert torch.allclose(k[..., -n:, :], wk[..., -n:, :], atol=1e-4)
        assert torch.allclose(v[..., -n:, :], wv[..., -n:, :], atol=1e-4)


def prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(3)
    fresh = [int(t) for t in torch.randint(17, VOCAB, (20,), generator=gen)]
    part = [int(t) for t in torch.randint(17, VOCAB, (9,), generator=gen)]
    repetitive = part + fresh[:5] + part + part[:4]  # lookup has matches from the start
    return {"fresh": fresh, "repetitive": repetitive}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, bundled_tokenizer):
    lm = family_model(request.param, bundled_tokenizer)
    plain = {}
    for name, prompt in prompts().items():
        # (a) to the end of the context window: the last token sits at position CONTEXT - 1
        params = SamplingParams(max_new_tokens=CONTEXT - len(prompt))
        plain[name] = run(lm, prompt, params)[1]
    return request.param, lm, plain


@pytest.mark.parametrize("method", METHODS)
def test_greedy_to_the_end_of_the_context_matches_plain_decoding(family, method, monkeypatch):
    name, lm, plain = family
    drafter = drafter_or_skip(name, lm, method)
    states = capture_state(monkeypatch)
    drafted = from_store = 0
    for key, prompt in prompts().items():
        params = SamplingParams(max_new_tokens=CONTEXT - len(prompt))
        _text, ids, stats = run(lm, prompt, params, drafter)
        assert ids == plain[key], (name, method, key)
        assert stats.tokens == len(ids) == params.max_new_tokens
        assert stats.stop_reason == "length"
        state = states[-1]
        # The cache holds every token but the last (chosen, never fed back).
        assert_same_cache(state.cache, one_by_one_cache(lm, state.ids[:-1]), state.cached)
        drafted += sum(stats.drafted)
        from_store += stats.datastore_drafted
    if "lookup" in method or method == "datastore":
        assert sum(stats.drafted) > 0  # the repetitive prompt made lookup draft
    if "datastore" in method or method == "auto":
        assert from_store > 0  # the store's drafts were verified
    assert drafted > 0  # the exactness above held while drafting, not by decoding plainly


@pytest.mark.parametrize("method", METHODS)
def test_sampled_replies_run_with_every_drafter(family, method):
    """Sampling draws with the generation's generator on the model's device (a CUDA
    generator is refused for CPU tensors): every drafter samples a whole reply."""
    name, lm, _plain = family
    drafter = drafter_or_skip(name, lm, method)
    for acceptance in ("auto", "typical"):
        params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=24, seed=1,
                                acceptance=acceptance)
        _t, ids, stats = run(lm, prompts()["repetitive"], params, drafter)
        assert len(ids) == stats.tokens == 24


@pytest.mark.parametrize("method", METHODS)
def test_a_stop_string_ends_every_drafter_where_it_ends_plain_decoding(family, method):
    name, lm, plain = family
    drafter = drafter_or_skip(name, lm, method)
    prompt = prompts()["repetitive"]
    reply = plain["repetitive"]
    # A stop string made of two character tokens (ids from 17 on) after the 15th.
    at = next(i for i in range(15, len(reply) - 1) if min(reply[i:i + 2]) >= 17)
    stop = lm.tokenizer.decode(reply[at:at + 2])
    params = SamplingParams(max_new_tokens=CONTEXT - len(prompt), stop=(stop,))
    want_text, want_ids, want = run(lm, prompt, params)
    text, ids, stats = run(lm, prompt, params, drafter)
    assert (text, ids) == (want_text, want_ids)
    assert stats.tokens == want.tokens == len(ids)
    assert stats.stop_reason == want.stop_reason == "stop"
    assert stats.steps + 1 + sum(stats.accepted) == stats.tokens


@pytest.mark.parametrize("step", ["auto", "transformers"])
@pytest.mark.parametrize("name", ["mistral-sliding", "gemma2-alternating", "gpt2-absolute"])
def test_a_tree_step_keeping_a_non_contiguous_path_equals_one_by_one_decoding(
        name, step, bundled_tokenizer):
    """Verify a token tree past the sliding window, keep a path that skips nodes, and
    compare the cache and the next logits with feeding the path one token at a time (the
    lean step and transformers' own; GPT-2 runs through transformers either way)."""
    from engine.decode.drafter import Draft, forward_nodes
    from engine.decode.generate import DecodeState
    from engine.decode.sampling import make_generator
    from engine.model.loading import make_target

    lm = family_model(name, bundled_tokenizer)
    lm = dataclasses.replace(lm, target=make_target(lm.model, step, torch.float32))
    target = lm.target
    prompt = prompts()["fresh"]  # 20 tokens: past the 8-token windows
    tree = build_tree([(0,), (1,), (0, 0), (1, 0), (1, 1)], 4)
    tokens = [30, 41, 52, 63, 74, 85]
    path = [2, 5]  # root -> (1,) -> (1, 1): entries 2 and 5 move to slots 1 and 2
    with torch.no_grad():
        cache = target.new_cache()
        target.forward(cache, prompt, 0)
        state = DecodeState(lm, SamplingParams(), cache, [*prompt, tokens[0]], len(prompt),
                            make_generator(0, DEVICE))
        forward_nodes(state, Draft(tokens, tree.children, tree.depths, tree.mask), False)
        target.keep_path(cache, len(prompt), [0, *path])
        kept = [*prompt, tokens[0], tokens[2], tokens[5]]
        assert_same_cache(cache, one_by_one_cache(lm, kept), len(kept))
        nxt = target.forward(cache, [77], len(kept)).logits
        ref = lm.model(input_ids=torch.tensor([kept + [77]], device=DEVICE)).logits[0, -1:]
    assert torch.allclose(nxt, ref, atol=1e-4)
