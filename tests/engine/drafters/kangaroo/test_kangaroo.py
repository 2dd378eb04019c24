"""Kangaroo decoding: greedy exactness, lossless speculative sampling, cache consistency,
the reduced draft vocabulary, and clear errors for bad input."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import engine.decode.generate as generate_mod
from engine.config import SamplingParams
from engine.decode import split, verify
from engine.decode.chat_template import conversation, encode
from engine.decode.generate import run
from engine.decode.sampling import sample_from
from engine.drafters.accelerators import load_checkpoint, save_checkpoint
from engine.drafters.kangaroo import (
    Adapter,
    KangarooDrafter,
    KangarooSession,
    KangarooSettings,
)
from engine.drafters.kangaroo_adapter import adapt
from engine.drafters.registry import load_drafter
from engine.errors import AcceleratorError
from tests.cache_util import held
from tests.conftest import make_tiny_model
from tests.engine.drafters.spy import Spy, sessions_of
from tests.stats_util import chi_square_pvalue

PROMPT = "Tell me a story about a lighthouse keeper."


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny models run thousands of small ops: one thread is faster and, on a shared
    machine, not slowed by other processes' threads. The bundled model keeps them all."""
    if "bundled_lm" in request.fixturenames:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def drafter(lm, exit_layer=2, eta=0.0, gamma=4, source=-1, initialised=False, vocab=None,
            seed=0):
    """A Kangaroo drafter with a random (or layer-`source`-initialised) adapter."""
    torch.manual_seed(seed)
    adapter = Adapter.from_model(lm.model, source) if initialised else Adapter(lm.model, source)
    return KangarooDrafter(lm, adapter, KangarooSettings(exit_layer, eta, gamma, source), vocab)


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
def test_greedy_matches_plain_decoding_on_tiny_configs(tiny_lm, exit_layer):
    ids = encode(tiny_lm.tokenizer, conversation(PROMPT))
    params = SamplingParams(max_new_tokens=40)
    _t, plain, _s = run(tiny_lm, ids, params)
    for d in (drafter(tiny_lm, exit_layer), drafter(tiny_lm, exit_layer, 0.3, 6, exit_layer, True)):
        _t, got, stats = run(tiny_lm, ids, params, d)
        assert got == plain
        assert stats.steps < stats.tokens  # something was drafted and checked each step


# Families beyond the shared tiny configs; sliding windows shorter than the context.
FAMILIES = {
    "mistral-sliding": ("mistral", dict(sliding_window=16)),
    "qwen2-sliding": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=2),
    ),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "gemma": ("gemma", dict(head_dim=16)),
    # alternating sliding / full layers, attention and final logit soft-capping
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=16,
                              final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "phi3": ("phi3", dict(pad_token_id=0)),  # fused qkv / gate-up projections
    "olmo2": ("olmo2", dict(pad_token_id=0)),  # norms after attention and FFN
    "smollm3": ("smollm3", dict(pad_token_id=0)),  # every 4th layer without rotary
    "gpt2": ("gpt2", {}),  # learned absolute positions, no rotary
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_plain_decoding_on_other_families(bundled_tokenizer, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.config import ModelSpec
    from engine.model.loading import wrap_model

    model_type, extra = FAMILIES[family]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(bundled_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lm = wrap_model(model, bundled_tokenizer, ModelSpec(source=family), family, "fp32")
    ids = list(range(5, 40))  # prompt + reply run past the 16-token windows
    params = SamplingParams(max_new_tokens=40)
    _t, plain, _s = run(lm, ids, params)
    for d in (drafter(lm, 1), drafter(lm, 2, 0.0, 4, 2, True), drafter(lm, 3, 0.0, 4, 3, True)):
        assert run(lm, ids, params, d)[1] == plain


def test_self_copy_adapter_accepts_every_draft(bundled_tokenizer):
    """With l = L - 1 and an FFN initialised from the last layer, the adapter *is* the last
    layer: every draft must be accepted, so positions, rotary and all caches line up."""
    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    ids = encode(lm.tokenizer, conversation(PROMPT))
    lm.eos_ids = ()
    d = drafter(lm, exit_layer=3, gamma=5, initialised=True)
    _t, got, stats = run(lm, ids, SamplingParams(max_new_tokens=61), d)
    assert stats.accepted == [5] * 10
    assert got == run(lm, ids, SamplingParams(max_new_tokens=61))[1]


def test_unconfident_drafts_stop_early(bundled_tokenizer):
    lm = make_tiny_model("llama-mha", bundled_tokenizer)
    ids = encode(lm.tokenizer, conversation(PROMPT))
    params = SamplingParams(max_new_tokens=30)
    _t, _ids, stats = run(lm, ids, params, drafter(lm, eta=0.999, gamma=6))
    assert set(stats.drafted) == {1}  # a random adapter is never 99.9% sure
    _t, _ids, stats = run(lm, ids, params, drafter(lm, eta=0.0, gamma=6))
    assert max(stats.drafted) == 6


def test_reduced_vocabulary_stays_exact(bundled_tokenizer):
    """Drafting over a few tokens: drafts outside the target's choice are rejected, output
    unchanged; the q rows put zero mass outside the reduced vocabulary."""
    lm = make_tiny_model("qwen2", bundled_tokenizer)
    ids = encode(lm.tokenizer, conversation(PROMPT))
    params = SamplingParams(max_new_tokens=40)
    _t, plain, _s = run(lm, ids, params)
    vocab = torch.tensor(sorted(set(plain[::2])))  # half the reply's tokens are draftable
    _t, got, stats = run(lm, ids, params, drafter(lm, 3, 0.0, 4, True, True, vocab))
    assert got == plain and sum(stats.accepted) > 0
    d = drafter(lm, vocab=vocab)
    state, session, _ = generate_mod._prefill(lm, ids, SamplingParams(temperature=1.0, seed=0), d,
                                              None)
    draft = session.propose(state)
    assert draft.draft_probs is not None
    outside = torch.ones(draft.draft_probs.shape[1], dtype=torch.bool)
    outside[vocab] = False
    assert float(draft.draft_probs[:, outside].sum()) == 0.0
    assert all(t in set(vocab.tolist()) for t in draft.tokens[1:])


# -- speculative sampling ----------------------------------------------------------------

VOCAB = 6


def _exact_joint(lm, prompt: list[int]) -> torch.Tensor:
    """(VOCAB**3,) probabilities of the first three sampled tokens, from the model itself."""
    grid = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # (V^2, 2)
    seqs = torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], dim=1)
    with torch.inference_mode():
        probs = lm.model(input_ids=seqs).logits.float().softmax(-1)  # (V^2, P + 2, V)
    p = len(prompt)
    p1 = probs[0, p - 1]  # (V,)
    p2 = probs[: VOCAB * VOCAB : VOCAB, p]  # rows with x2 = 0 -> (V, V) p(x2 | x1)
    p3 = probs[:, p + 1].reshape(VOCAB, VOCAB, VOCAB)  # p(x3 | x1, x2)
    return (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)


def _sampled_joint(lm, prompt, d, n: int) -> torch.Tensor:
    counts = torch.zeros(VOCAB**3)
    for seed in range(n):
        params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=seed)
        _t, ids, _s = run(lm, prompt, params, d)
        counts[ids[0] * VOCAB * VOCAB + ids[1] * VOCAB + ids[2]] += 1
    return counts


def _broken_rule(tokens, draft_probs, target_probs, generator):
    """Speculative sampling with a classic bug: on rejection, resample from p, not p - q."""
    path = []
    for j in range(len(tokens) - 1):
        d = tokens[j + 1]
        p, q = target_probs[j], draft_probs[j]
        if float(torch.rand((), generator=generator)) < min(1.0, float(p[d] / q[d])):
            path.append(j + 1)
            continue
        return path, sample_from(p, generator)
    return path, sample_from(target_probs[-1], generator)


def test_speculative_sampling_is_lossless_and_catches_a_broken_rule(bundled_tokenizer, monkeypatch):
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, vocab_size=VOCAB, num_layers=3)
    lm.eos_ids = ()
    prompt = [1, 4, 2, 5, 3]
    d = drafter(lm, exit_layer=1, eta=0.0, gamma=3, seed=3)
    exact = _exact_joint(lm, prompt)
    assert chi_square_pvalue(_sampled_joint(lm, prompt, d, 800), exact) > 1e-3
    monkeypatch.setattr(verify, "accept_speculative_chain", _broken_rule)
    assert chi_square_pvalue(_sampled_joint(lm, prompt, d, 800), exact) < 1e-3


# -- cache consistency -------------------------------------------------------------------


def recording(drafter, kangaroo: KangarooDrafter) -> Spy:
    """`drafter` (Kangaroo alone or a composite with it) recording, after every commit, the
    committed tokens, copies of all caches and the Kangaroo session's adapter cache + unread;
    `kangaroo` is the drafter whose settings and adapter the check reads."""

    def snapshot(state, draft, path, session):
        own = next(s for s in sessions_of(session) if isinstance(s, KangarooSession))
        committed = state.ids + [draft.tokens[i] for i in path]
        copy = [(k.clone(), v.clone()) for k, v in held(state.cache, len(committed))]
        ad = own.cache.layers[0]
        spy.snapshots.append((committed, copy, ad.keys.clone(), ad.values.clone(),
                              own.unread.clone()))

    spy = Spy(drafter, snapshot)
    spy.snapshots, spy.kangaroo = [], kangaroo
    return spy


def check_caches_after_random_accepts(lm, d, prompt, monkeypatch, tokens=80) -> set[int]:
    """Decode with random acceptance patterns; after every step, each layer's cache and the
    adapter's (cache + unread) must equal those of the committed tokens run one by one.
    Returns the unread lengths seen."""
    rng = torch.Generator().manual_seed(0)
    top = min(500, int(lm.model.config.vocab_size))  # the token the target "adds"

    def random_accept(draft, logits, params, generator):
        node = int(torch.randint(0, draft.size, (), generator=rng))  # the last node kept
        parent = {c: p for p, kids in enumerate(draft.children) for c in kids}
        path = []
        while node:  # a chain keeps nodes 1..node; a tree the branch down to it
            path.insert(0, node)
            node = parent[node]
        return path, int(torch.randint(0, top, (), generator=rng))

    monkeypatch.setattr(generate_mod, "accept", random_accept)
    d.snapshots = []
    run(lm, prompt, SamplingParams(max_new_tokens=tokens), d)
    final = d.snapshots[-1][0]
    exit_layer = d.kangaroo.settings.exit_layer
    ref = DynamicCache(config=lm.model.config)
    with torch.inference_mode():
        for t in final:  # the reference: one token at a time
            lm.model(input_ids=torch.tensor([[t]]), cache=ref, use_cache=True)
        hidden = lm.model(input_ids=torch.tensor([final]), output_hidden_states=True).hidden_states
        exit_states = split.exit_states(hidden, exit_layer)
        ad_ref = DynamicCache()
        adapt(lm.model, d.kangaroo.adapter, exit_states, 0, ad_ref)
    kept = set()
    for committed, caches, ad_k, ad_v, unread in d.snapshots:
        n = len(committed)
        assert committed == final[:n]
        for (k, v), (rk, rv) in zip(caches, held(ref, len(final)), strict=True):
            torch.testing.assert_close(k, rk[:, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, rv[:, :n], atol=1e-4, rtol=1e-4)
        m = ad_k.shape[-2]
        assert m + unread.shape[1] == n  # the adapter has read, or will read, every committed token
        torch.testing.assert_close(ad_k, ad_ref.layers[0].keys[..., :m, :], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ad_v, ad_ref.layers[0].values[..., :m, :], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(unread[0], exit_states[0, m:n], atol=1e-4, rtol=1e-4)
        kept.add(unread.shape[1])
    return kept


@pytest.mark.parametrize("step", ["auto", "transformers"])
def test_caches_equal_one_by_one_decoding_after_any_accept_pattern(bundled_tokenizer, monkeypatch,
                                                                   step):
    from engine.model.loading import make_target

    lm = make_tiny_model("qwen2", bundled_tokenizer)
    lm.eos_ids = ()
    lm.target = make_target(lm.model, step, torch.float32)
    torch.manual_seed(0)
    k = KangarooDrafter(lm, Adapter(lm.model), KangarooSettings(exit_layer=2, eta=0.0, gamma=4))
    kept = check_caches_after_random_accepts(lm, recording(k, k), [5, 6, 7, 8, 9],
                                             monkeypatch)
    assert kept == {0, 1}  # both partial and full acceptance happened


# -- checkpoints and bad input -----------------------------------------------------------


def test_checkpoint_round_trip_and_bad_input(bundled_tokenizer):
    lm = make_tiny_model("llama-untied", bundled_tokenizer)
    d = drafter(lm, exit_layer=3, gamma=3, initialised=True, vocab=torch.arange(0, 4000))
    settings = d.settings.to_json()
    save_checkpoint(lm, "kangaroo", d.tensors(), settings, {"pays": True, "speedup": 1.3})
    loaded = load_drafter(lm, "kangaroo")
    ids = encode(lm.tokenizer, conversation(PROMPT))
    params = SamplingParams(max_new_tokens=20)
    assert run(lm, ids, params, loaded)[1] == run(lm, ids, params, d)[1]
    assert loaded.settings == d.settings and torch.equal(loaded.vocab, d.vocab)

    other = make_tiny_model("llama-untied", bundled_tokenizer, seed=1)  # another model
    with pytest.raises(AcceleratorError, match="no kangaroo accelerator is trained"):
        load_drafter(other, "kangaroo")
    with pytest.raises(AcceleratorError, match="built for another model"):
        load_checkpoint(other, "kangaroo", folder=loaded_folder(lm))
    qwen = make_tiny_model("qwen2", bundled_tokenizer)  # q/k/v biases: another adapter layout
    ckpt = load_checkpoint(lm, "kangaroo")
    with pytest.raises(AcceleratorError, match="does not match this model's layout"):
        KangarooDrafter.from_checkpoint(qwen, ckpt)
    ckpt.info["settings"]["format"] = 1  # the hand-built attention block of earlier versions
    with pytest.raises(AcceleratorError, match="adapter format 1, not 2; retrain it"):
        KangarooDrafter.from_checkpoint(lm, ckpt)
    ckpt.info["settings"]["format"] = 2
    ckpt.info["settings"]["exit_layer"] = 9
    with pytest.raises(AcceleratorError, match="exit layer 9 is outside"):
        KangarooDrafter.from_checkpoint(lm, ckpt)
    (loaded_folder(lm) / "drafter.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AcceleratorError, match="corrupt"):
        load_drafter(lm, "kangaroo")


def loaded_folder(lm):
    from engine.drafters.accelerators import checkpoint_dir

    return checkpoint_dir(lm.fingerprint, "kangaroo")


def test_unsupported_architecture_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config = AutoConfig.for_model("t5", vocab_size=100, d_model=32, d_ff=64, num_layers=1,
                                  num_heads=2, d_kv=16)
    with pytest.raises(AcceleratorError, match="not supported for this architecture"):
        split.check_supported(AutoModelForSeq2SeqLM.from_config(config))
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=2,
                                                                 n_head=2, vocab_size=100))
    del gpt2.transformer.wpe  # a layout neither of the known two
    with pytest.raises(AcceleratorError, match="not supported for this architecture"):
        split.check_supported(gpt2)


def test_a_drafter_that_does_not_pay_says_so_and_decodes_plainly(bundled_tokenizer, caplog):
    lm = make_tiny_model("llama-mha", bundled_tokenizer)
    d = drafter(lm)
    settings = {**d.settings.to_json(), "gamma": 0}  # what calibration stores when nothing pays
    save_checkpoint(lm, "kangaroo", d.tensors(), settings, {"pays": False, "speedup": 0.8})
    loaded = load_drafter(lm, "kangaroo")
    assert "slower than plain decoding on this machine (0.80x)" in caplog.text
    assert not loaded.pays_off
    ids = encode(lm.tokenizer, conversation(PROMPT))
    _t, got, stats = run(lm, ids, SamplingParams(max_new_tokens=20), loaded)
    assert got == run(lm, ids, SamplingParams(max_new_tokens=20))[1]
    assert set(stats.drafted) == {0}


# -- the bundled model -------------------------------------------------------------------


def test_adapter_adds_under_five_percent_of_the_bundled_model(bundled_lm):
    from trainer.kangaroo.train_adapter import fitting_vocab

    model_bytes = sum(p.numel() * p.element_size() for p in bundled_lm.model.parameters())
    rows = fitting_vocab(bundled_lm.model, 8192, 0.05)
    assert rows >= 4096  # room for a useful draft vocabulary
    d = drafter(bundled_lm, initialised=True, vocab=torch.arange(rows))
    assert d.extra_bytes() <= 0.05 * model_bytes


@pytest.mark.slow
def test_greedy_matches_plain_decoding_on_the_bundled_model(bundled_lm):
    ids = encode(bundled_lm.tokenizer, conversation("Give me three tips for learning to cook."))
    params = SamplingParams(max_new_tokens=40)
    _t, plain, _s = run(bundled_lm, ids, params)
    for exit_layer in (1, 2, 3):
        _t, got, _s = run(bundled_lm, ids, params, drafter(bundled_lm, exit_layer, 0.0, 4))
        assert got == plain, exit_layer
