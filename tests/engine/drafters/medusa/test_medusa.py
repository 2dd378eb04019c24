"""Medusa in the decode loop on tiny models: greedy exactness (random and trained heads),
lossless sampling, the cache after a tree step, and the heads' starting point."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import SamplingParams
from engine.decode import kv_cache, verify
from engine.decode.chat_template import conversation, encode
from engine.decode.drafter import Draft, forward_nodes
from engine.decode.generate import DecodeState, run
from engine.decode.sampling import make_generator, sample_from
from engine.decode.tree import build_tree, greedy_tree
from engine.drafters.medusa import MedusaDrafter, MedusaHeads, MedusaSettings, pending_inputs
from tests.conftest import make_tiny_model
from tests.stats_util import chi_square_pvalue
from trainer.features import encode_conversations, hidden_states
from trainer.medusa.train_heads import MedusaTrainConfig, fit_heads, teacher_topk
from trainer.training_loop import TrainConfig

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
# A bushy 16-node tree: three guesses for the next token, fewer deeper down.
TREE = greedy_tree([[0.5, 0.3, 0.2], [0.4, 0.2, 0.1], [0.3, 0.1], [0.2, 0.1]], 16)


def random_heads(lm, scale: float = 0.3, seed: int = 1, pending: bool = True) -> MedusaHeads:
    """Heads with random residual weights: their guesses differ from the model's (and,
    reading the pending token, from one step to the next)."""
    rank = 16 if pending else 0
    heads = MedusaHeads(int(lm.model.config.hidden_size), MedusaSettings(4, pending_rank=rank))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in (heads.weight, *([heads.token_up] if pending else [])):
            w.copy_(torch.randn(w.shape, generator=gen) * scale / w.shape[-1] ** 0.5)
        heads.bias.copy_(torch.randn(heads.bias.shape, generator=gen) * scale)
    return heads


def medusa(lm, heads, choices=TREE) -> MedusaDrafter:
    return MedusaDrafter(lm, heads, build_tree(choices, heads.settings.num_heads))


def small_vocab_model(tokenizer, name: str, vocab: int, seed: int = 0):
    """A tiny model over `vocab` tokens that never stops early (no end-of-sequence token),
    so every reply has its full length."""
    lm = make_tiny_model(name, tokenizer, vocab_size=vocab, num_layers=2, seed=seed)
    return dataclasses.replace(lm, eos_ids=())


@pytest.mark.parametrize("pending", [True, False])
def test_random_heads_match_plain_greedy(tiny_lm, pending):
    drafter = medusa(tiny_lm, random_heads(tiny_lm, pending=pending))
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=40)
        assert run(tiny_lm, prompt, params, drafter)[1] == run(tiny_lm, prompt, params)[1]


def test_trained_heads_match_plain_greedy(tiny_lm, tmp_path, monkeypatch):
    """Heads trained on the model's own replies (the real trainer, a few seconds)."""
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path))  # a private feature cache
    lm = tiny_lm
    replies = [
        run(lm, encode(lm.tokenizer, conversation(p)), SamplingParams(max_new_tokens=24))[0]
        for p in ("Tell me a story.", "List three colours.")
    ]
    convs = [
        [{"role": "user", "content": p}, {"role": "assistant", "content": r}]
        for p, r in zip(("Tell me a story.", "List three colours."), replies, strict=True)
    ]
    ids, masks = encode_conversations(lm, convs)
    final = int(lm.model.config.num_hidden_layers)
    feats = hidden_states(lm, ids, [final], masks).load()
    teacher = teacher_topk(lm, feats.states[final], 4)
    heads = MedusaHeads(int(lm.model.config.hidden_size), MedusaSettings(4))
    cfg = MedusaTrainConfig(teacher_topk=4, negatives=64, batch_positions=32)
    fit_heads(lm, heads, (feats, teacher), (feats, teacher), cfg, TrainConfig(lr=0.03, epochs=20))
    assert heads.weight.abs().sum() > 0 and heads.token_up.abs().sum() > 0  # trained
    drafter = medusa(lm, heads)
    params = SamplingParams(max_new_tokens=40)
    for prompt in [*ids, *PROMPTS]:
        assert run(lm, prompt[:12], params, drafter)[1] == run(lm, prompt[:12], params)[1]


def test_greedy_matches_when_many_drafts_are_accepted(bundled_tokenizer):
    """A 12-token vocabulary makes random guesses right often, so long paths get accepted."""
    lm = small_vocab_model(bundled_tokenizer, "llama-untied", 12)
    drafter = medusa(lm, random_heads(lm))
    params = SamplingParams(max_new_tokens=60)
    for prompt in [[1, 2, 3], [5, 4, 3, 2, 1]]:
        _t, ids, stats = run(lm, prompt, params, drafter)
        assert ids == run(lm, prompt, params)[1]
        assert stats.mean_accepted > 1.3  # the acceptance paths were really exercised
        assert max(stats.accepted) >= 2


def test_typical_acceptance_at_zero_temperature_is_greedy(bundled_tokenizer):
    lm = small_vocab_model(bundled_tokenizer, "qwen2", 12)
    params = SamplingParams(max_new_tokens=40, acceptance="typical")
    assert (
        run(lm, [3, 1, 4], params, medusa(lm, random_heads(lm)))[1] == run(lm, [3, 1, 4], params)[1]
    )


def test_untrained_heads_repeat_the_models_next_token_guess(tiny_lm):
    """W = U = 0 and b = 0: every head starts as the model's own LM head (Medusa §2.1.1),
    whatever the pending token."""
    heads = MedusaHeads(int(tiny_lm.model.config.hidden_size), MedusaSettings(3))
    hidden = torch.randn(5, heads.weight.shape[-1])
    pending = pending_inputs(tiny_lm.model.get_input_embeddings(), torch.arange(5))
    lm_head = tiny_lm.model.get_output_embeddings()
    logits = heads.logits(hidden, pending, heads.project(lm_head.weight))  # (5, K, V)
    assert logits.shape == (5, 3, lm_head.weight.shape[0])
    for k in range(3):
        assert torch.allclose(logits[:, k], lm_head(hidden), atol=1e-5)
    own = MedusaHeads(
        heads.weight.shape[-1], MedusaSettings(3, own_vocab=True), None, lm_head.weight
    )
    assert torch.allclose(own.logits(hidden, pending, lm_head.weight), logits, atol=1e-5)


def test_a_draft_vocabulary_limits_what_heads_propose(tiny_lm):
    ids = torch.tensor([3, 17, 200, 4000])
    heads = MedusaHeads(int(tiny_lm.model.config.hidden_size), MedusaSettings(2, pending_rank=0),
                        ids)
    weight = tiny_lm.model.get_output_embeddings().weight
    hidden = torch.randn(6, weight.shape[1])
    logits = heads.logits(hidden, None, heads.project(weight))  # (6, K, 4): draft vocabulary
    assert logits.shape == (6, 2, 4)
    assert torch.allclose(logits[:, 0], hidden @ weight[ids].T, atol=1e-5)
    assert set(heads.tokens(logits.argmax(-1)).flatten().tolist()) <= set(ids.tolist())
    drafter = medusa(tiny_lm, heads, [(0,), (1,), (0, 0)])
    params = SamplingParams(max_new_tokens=12)
    assert run(tiny_lm, PROMPTS[0], params, drafter)[1] == run(tiny_lm, PROMPTS[0], params)[1]


def test_no_tree_means_plain_decoding(tiny_lm):
    drafter = medusa(tiny_lm, random_heads(tiny_lm), [])
    _t, ids, stats = run(tiny_lm, PROMPTS[0], SamplingParams(max_new_tokens=10), drafter)
    assert not drafter.pays_off and set(stats.drafted) == {0}
    assert ids == run(tiny_lm, PROMPTS[0], SamplingParams(max_new_tokens=10))[1]


def test_cache_after_a_tree_step_equals_decoding_the_path_one_by_one(tiny_lm):
    """Verify a tree, keep a non-contiguous path, and compare with sequential decoding
    (transformers' cache; the lean cache's test is in test_family_matrix.py)."""
    from engine.model.loading import make_target

    model, prompt = tiny_lm.model, PROMPTS[0]
    tiny_lm = dataclasses.replace(tiny_lm, target=make_target(model, "transformers",
                                                              torch.float32))
    choices = [(0,), (1,), (0, 0), (1, 0), (1, 1)]  # nodes: 1=(0,) 2=(1,) 3 4=(1,0) 5=(1,1)
    tree = build_tree(choices, 4)
    tokens = [9, 100, 200, 300, 400, 500]
    path = [2, 5]  # root -> (1,) -> (1, 1): entries 2 and 5 must move to slots 1 and 2
    with torch.no_grad():
        cache = kv_cache.new_cache(model)
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        state = DecodeState(
            tiny_lm, SamplingParams(), cache, [*prompt, tokens[0]], len(prompt), make_generator(0)
        )
        forward_nodes(
            state, Draft(tokens, tree.children, tree.depths, tree.mask), want_hidden=False
        )
        kv_cache.keep_path(cache, len(prompt), [0, *path])
        ref = kv_cache.new_cache(model)
        model(input_ids=torch.tensor([prompt]), cache=ref, use_cache=True)
        for t in [tokens[0], tokens[2], tokens[5]]:
            model(input_ids=torch.tensor([[t]]), cache=ref, use_cache=True)
    assert cache.get_seq_length() == ref.get_seq_length() == len(prompt) + 3
    for got, want in zip(cache.layers, ref.layers, strict=True):
        assert torch.allclose(got.keys, want.keys, atol=1e-5)
        assert torch.allclose(got.values, want.values, atol=1e-5)


# --- lossless sampling ---------------------------------------------------------------------


def _exact_joint(lm, prompt, n_tokens: int) -> torch.Tensor:
    """P(first n_tokens of the reply), enumerated from the model itself: (V ** n,)."""
    vocab = lm.model.config.vocab_size
    probs = torch.ones(1)
    prefixes = [[]]
    for _ in range(n_tokens):
        rows = []
        with torch.no_grad():
            for pre in prefixes:
                logits = lm.model(torch.tensor([prompt + pre])).logits[0, -1]
                rows.append(torch.softmax(logits.double(), -1))
        probs = (probs.unsqueeze(-1) * torch.stack(rows)).reshape(-1)
        prefixes = [pre + [t] for pre in prefixes for t in range(vocab)]
    return probs


def _sampled_joint(lm, prompt, drafter, n_tokens: int, runs: int) -> torch.Tensor:
    vocab = lm.model.config.vocab_size
    counts = torch.zeros(vocab**n_tokens, dtype=torch.long)
    for seed in range(runs):
        params = SamplingParams(temperature=1.0, max_new_tokens=n_tokens, seed=seed)
        ids = run(lm, prompt, params, drafter)[1]
        cell = 0
        for t in ids[:n_tokens]:
            cell = cell * vocab + t
        counts[cell] += 1
    return counts


def _forgetful_pointmass(children, tokens, target_probs, generator):
    """A broken rule: rejected children are not removed before the next try / the resample."""
    path, node = [], 0
    while True:
        p = target_probs[node]
        chosen = next(
            (
                c
                for c in children[node]
                if float(torch.rand((), generator=generator)) < float(p[tokens[c]])
            ),
            None,
        )
        if chosen is None:
            return path, sample_from(p, generator)
        path.append(chosen)
        node = chosen


@pytest.fixture(scope="module")
def sampling_case(bundled_tokenizer):
    """An 8-token model (so joint frequencies are countable) and heads that guess often."""
    lm = small_vocab_model(bundled_tokenizer, "llama-untied", 8, seed=3)
    prompt = [1, 5, 2]
    drafter = medusa(lm, random_heads(lm, seed=2), [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
    return lm, prompt, drafter, _exact_joint(lm, prompt, 3)


RUNS = 1500


def test_lossless_sampling_matches_the_models_distribution(sampling_case):
    lm, prompt, drafter, exact = sampling_case
    counts = _sampled_joint(lm, prompt, drafter, 3, RUNS)
    assert chi_square_pvalue(counts, exact) > 1e-3


def test_the_statistical_test_catches_a_broken_rule(sampling_case, monkeypatch):
    lm, prompt, drafter, exact = sampling_case
    monkeypatch.setattr(verify, "accept_pointmass", _forgetful_pointmass)
    counts = _sampled_joint(lm, prompt, drafter, 3, RUNS)
    assert chi_square_pvalue(counts, exact) < 1e-3


def test_a_reply_whose_cut_cannot_pay_decodes_plainly_without_planning_each_step(
        tiny_lm, monkeypatch):
    """Where no cut of the tree pays at the step costs, nothing later in the reply can
    change that (only drafted nodes move its correction): one estimate, then plain steps
    that ask for no final states, with plain decoding's tokens."""
    tree = build_tree(TREE, 4)
    drafter = MedusaDrafter(tiny_lm, random_heads(tiny_lm), tree,
                            chances=[0.05] * (tree.size - 1), overhead=5.0)
    estimates, asked = [], []
    value = drafter.value
    monkeypatch.setattr(drafter, "value", lambda *a, **k: estimates.append(1) or value(*a, **k))
    forward = tiny_lm.target.forward
    monkeypatch.setattr(tiny_lm.target, "forward",
                        lambda *a, **k: asked.append(k.get("states")) or forward(*a, **k))
    params = SamplingParams(max_new_tokens=20)
    tokens = run(tiny_lm, PROMPTS[0], params, drafter)[1]
    steps = asked[2:]  # past the prefill and the first step, which read the heads' state
    assert len(estimates) == 1 and len(steps) >= 15 and not any(steps)
    monkeypatch.undo()
    assert tokens == run(tiny_lm, PROMPTS[0], params)[1]
