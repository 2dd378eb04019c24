"""The lean decode step (engine/lean/) against transformers' own forward: every covered
family decodes the same tokens and states in fp32, long prompts and long replies included;
the compiled step equals the eager one, is kept on disk and loaded on the next start, and a
failure to compile leaves the eager step decoding; steps over static buffers (CUDA graphs)
decode as the eager step does, in one memory pool, and read no stale slot of a finished reply."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import ModelSpec, SamplingParams
from engine.decode.generate import generate, run
from engine.decode.target import TransformersTarget
from engine.drafters.lookup import LookupDrafter
from engine.lean import builder, compiled, graphs
from engine.lean.lean_target import LeanTarget
from engine.model.loading import make_target, wrap_model
from engine.weights import kernels, quant
from tests.engine.test_family_matrix import make_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 100
# scripts/gpu_check.py runs this module on CUDA; the suite runs it on the CPU.
DEVICE = torch.device(os.environ.get("QUICKDRAFT_TEST_DEVICE", "cpu"))
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)
FAMILIES = {
    "llama": ("llama", BASE),
    "mistral-sliding": ("mistral", {**BASE, "sliding_window": 8}),
    "qwen2-bias": ("qwen2", {**BASE, "tie_word_embeddings": False}),
    "qwen3-qknorm": ("qwen3", {**BASE, "head_dim": 16}),
    "phi3-fused": ("phi3", {**BASE, "pad_token_id": 0}),
    "gemma2-softcap": ("gemma2", {**BASE, "sliding_window": 8, "head_dim": 16,
                                  "query_pre_attn_scalar": 16, "final_logit_softcapping": 30.0,
                                  "attn_logit_softcapping": 50.0}),
    "olmo2-postnorm": ("olmo2", BASE),
}


def family_lm(name: str, tokenizer, step: str = "auto"):
    model_type, extra = FAMILIES[name]
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, initializer_range=0.2, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(DEVICE)
    lm = wrap_model(model, tokenizer, ModelSpec(source=name, step=step), name, "fp32")
    return dataclasses.replace(lm, eos_ids=())


def as_transformers(lm):
    return dataclasses.replace(lm, target=make_target(lm.model, "transformers", torch.float32))


def prompt(n: int, seed: int = 3) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, VOCAB, (n,), generator=gen)]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_decodes_as_transformers_does(name, bundled_tokenizer):
    lm = family_lm(name, bundled_tokenizer)
    assert isinstance(lm.target, LeanTarget)
    ref = as_transformers(lm)
    params = SamplingParams(max_new_tokens=40)
    ids = prompt(20)
    assert run(lm, ids, params)[1] == run(ref, ids, params)[1]
    # every layer's states over a prompt, as the drafters read them
    with torch.inference_mode():
        lean = lm.target.forward(lm.target.new_cache(), ids, 0, states=True)
        want = ref.target.forward(ref.target.new_cache(), ids, 0, states=True)
    assert len(lean.states) == len(want.states)
    for a, b in zip(lean.states, want.states, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lean.logits, want.logits, atol=1e-4, rtol=1e-4)


def test_a_model_outside_the_families_keeps_transformers(bundled_tokenizer):
    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4)
    model = AutoModelForCausalLM.from_config(config).to(DEVICE)
    lm = wrap_model(model, bundled_tokenizer, ModelSpec(source="gpt2"), "gpt2", "fp32")
    assert isinstance(lm.target, TransformersTarget)
    llama = family_lm("llama", bundled_tokenizer, step="transformers")
    assert isinstance(llama.target, TransformersTarget)  # asked for


def test_long_prompts_and_replies_past_the_first_allocation(bundled_tokenizer):
    """A prompt longer than one prefill chunk, and a reply that outgrows the cache's first
    allocation (it doubles), decode as transformers does."""
    lm = family_lm("qwen2-bias", bundled_tokenizer)
    ref = as_transformers(lm)
    ids = prompt(600, seed=5)  # > PREFILL_CHUNK (512)
    params = SamplingParams(max_new_tokens=20)
    assert run(lm, ids, params)[1] == run(ref, ids, params)[1]
    short = prompt(10)
    params = SamplingParams(max_new_tokens=560)  # past 512 slots
    assert run(lm, short, params)[1] == run(ref, short, params)[1]


# On CUDA compiling means capturing graphs (test_graphed_steps_decode_as_the_eager_step).
cpu_packages = pytest.mark.skipif(DEVICE.type == "cuda", reason="AOTInductor packages: CPU")


@pytest.fixture
def small_sizes(monkeypatch, tmp_path):
    """Two compiled sizes instead of five (compiling is slow), and their packages in the
    test's cache folder."""
    monkeypatch.setattr(compiled, "SIZES", (1, 4))
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@cpu_packages
def test_the_compiled_step_equals_the_eager_one_and_is_kept(bundled_tokenizer, small_sizes,
                                                            monkeypatch):
    lm = family_lm("llama", bundled_tokenizer)
    eager = family_lm("llama", bundled_tokenizer, step="eager")
    ids = prompt(9, seed=7) * 3  # repeats: lookup drafts, steps of 2..4 tokens are padded
    params = SamplingParams(max_new_tokens=30)
    want = run(eager, ids, params, LookupDrafter())[1]
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")  # as in the app: inductor's files go
    heard = []  # to the cache folder, beside the packages
    lm.target.compile("wait", report=heard.append)  # built by a builder process
    assert lm.target.name == "lean-compiled", lm.target.steps.failed
    assert list((small_sizes / "inductor").rglob("*.so"))
    assert heard and all(s.state == "building" for s in heard)
    folder = next(small_sizes.glob("compiled/*"))
    assert builder.read(folder).state == "done" and builder.read(folder).pid != os.getpid()
    _text, got, stats = run(lm, ids, params, LookupDrafter())
    assert got == want and stats.step == "lean-compiled"
    assert sum(stats.drafted) > 0
    assert list(small_sizes.rglob("layer-*.pt2"))
    # the next start loads what was built: nothing is built again
    monkeypatch.setattr(builder, "start", _no_builder)
    again = family_lm("llama", bundled_tokenizer)
    again.target.compile("watch")
    assert again.target.name == "lean-compiled"
    assert run(again, ids, params, LookupDrafter())[1] == want


def test_packages_are_kept_per_cpu_feature_set(monkeypatch):
    """inductor compiles for -march=native: a CPU with other feature flags (a cache copied to
    another machine of the same capability) gets packages of its own."""
    from engine import devices

    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "avx512_f", "avx512_vnni"})
    vnni = compiled.package_folder("a model")
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "avx512_f"})
    assert compiled.package_folder("a model") != vnni
    assert compiled.package_folder("another model") != compiled.package_folder("a model")


@cpu_packages
def test_the_compiled_int8_step_gives_the_eager_steps_logits_and_replies(bundled_tokenizer,
                                                                        small_sizes):
    """int8 weights and bf16 activations: the compiled package calls the same kernel as the
    eager step (on a CPU Quickdraft's own, an operator of its library inside the package),
    rounds where eager rounds and runs eager's own norms, softmax and activation: the same
    logits bit for bit, at every step size (padded alike). A reply that starts eager and
    goes on compiled (the build finished mid-reply) is the eager reply, drafts and all."""
    def int8(step):
        lm = family_lm("llama", bundled_tokenizer, step=step)
        model = quant.quantize_model(lm.model, "int8w", wide_rows=0)
        return dataclasses.replace(wrap_model(model, lm.tokenizer, lm.spec, "llama", "int8w"),
                                   eos_ids=())
    lm, eager = int8("auto"), int8("eager")
    if DEVICE.type == "cpu" and kernels.available():
        # the block kernel's layout: the codes' block type (int64) in place of scales
        assert lm.target.weights[0].down.weight.kernel == "blocks"
    lm.target.compile("wait")
    assert lm.target.name == "lean-compiled", lm.target.steps.failed
    ids = prompt(12, seed=5)
    caches = [t.target.new_cache() for t in (lm, eager)]
    with torch.inference_mode():
        for t, cache in zip((lm, eager), caches, strict=True):
            t.target.forward(cache, ids, 0, last_only=True)
        # a plain step, a 4-token one, a 3-token one padded to 4, and a 2-token tree
        tree = torch.tensor([[True, False], [False, True]])
        for start, step, mask in ((12, ids[:1], None), (13, ids[1:5], None),
                                  (17, ids[5:8], None), (20, ids[8:10], tree)):
            depths = [0, 0] if mask is not None else None
            got, want = (t.target.forward(c, step, start, depths, mask).logits
                         for t, c in zip((lm, eager), caches, strict=True))
            assert torch.equal(got, want), (start, (got - want).abs().max())
    # across the switch: the reply's first steps eager, the rest compiled
    ready = lm.target.steps.ready
    replay = int8("auto")
    params = SamplingParams(max_new_tokens=40)
    events = generate(replay, ids * 3, params, LookupDrafter())
    got = []
    for i, event in enumerate(events):
        got += event.token_ids
        if i == 3:
            assert replay.target.name == "lean-eager"
            replay.target.steps.ready = ready  # the build lands mid-reply
        if event.done:
            assert event.stats.step == "lean-compiled" and sum(event.stats.drafted) > 0
    assert got == run(eager, ids * 3, params, LookupDrafter())[1]
    assert got == run(lm, ids * 3, params, LookupDrafter())[1]


def _no_builder(*_args, **_kwargs):
    raise AssertionError("a builder was started")


@cpu_packages
def test_a_failure_to_compile_leaves_the_eager_step(bundled_tokenizer, small_sizes, monkeypatch,
                                                    caplog):
    monkeypatch.setenv("CXX", "/nowhere/c++")  # the builder finds no C++ compiler
    lm = family_lm("llama", bundled_tokenizer)
    want = run(family_lm("llama", bundled_tokenizer, step="eager"), prompt(8),
               SamplingParams(max_new_tokens=12))[1]
    lm.target.compile("wait")
    assert lm.target.name == "lean-eager (compiling failed)"
    assert "/nowhere/c++" in caplog.text and lm.target.steps.failed in caplog.text
    _text, got, stats = run(lm, prompt(8), SamplingParams(max_new_tokens=12))
    assert got == want and stats.step == "lean-eager (compiling failed)"


@cpu_packages
def test_building_waits_for_an_explicit_ask(bundled_tokenizer, small_sizes, monkeypatch):
    """Only loading packages already built never starts a builder."""
    monkeypatch.setattr(builder, "start", _no_builder)
    lm = family_lm("llama", bundled_tokenizer)
    lm.target.compile("load")
    assert lm.target.name == "lean-eager" and not list(small_sizes.rglob("*.pt2"))


@pytest.mark.parametrize("name", ["llama", "gemma2-softcap"])
def test_graphed_steps_decode_as_the_eager_step(name, bundled_tokenizer, monkeypatch):
    """Steps over buffers they own (CUDA graphs on a GPU; on a CPU the same buffers run
    eagerly), attending over the cache's whole capacity: Medusa's trees with the states
    they read, Kangaroo's split layers and lookup's chains decode the eager step's tokens,
    also once the cache grows past its first allocation (its graphs are dropped). Every
    step of a target is captured into the one memory pool the target made."""
    captured, calls, pools = [], [], []  # calls: (a cache's table of steps, key, already there)
    real, real_replay, real_pool = graphs.StaticStep.__init__, graphs.replay, graphs.new_pool

    def spy(self, body, values, capture, pool):
        captured.append((capture, pool))
        real(self, body, values, capture, pool)

    def replay(table, key, body, values, pool):
        calls.append((table, key, key in table))
        return real_replay(table, key, body, values, pool)

    def new_pool(device):  # a CPU captures nothing and has no pool: a token stands in
        pools.append(real_pool(device) if device.type == "cuda" else object())
        return pools[-1]

    monkeypatch.setattr(graphs.StaticStep, "__init__", spy)
    monkeypatch.setattr(graphs, "replay", replay)
    monkeypatch.setattr(graphs, "new_pool", new_pool)
    ids = prompt(9, seed=7) * 55  # 495 tokens that repeat: lookup drafts; the reply passes 512
    params = SamplingParams(max_new_tokens=40)
    for method in ("medusa+lookup", "kangaroo+lookup"):
        eager = family_lm(name, bundled_tokenizer, step="eager")
        want = run(eager, ids, params, make_drafter(eager, method))[1]
        lm = family_lm(name, bundled_tokenizer)
        if DEVICE.type == "cuda":
            lm.target.compile()  # what compiling is on CUDA: nothing to build
        else:
            lm.target.graphed = True
        captured.clear()
        calls.clear()
        pools.clear()
        drafter = make_drafter(lm, method)
        _text, got, stats = run(lm, ids, params, drafter)
        assert got == want and stats.step == "lean-graphs", method
        assert captured and all(c == (DEVICE.type == "cuda") for c, _ in captured)
        assert sum(stats.drafted) > 0
        # the next reply takes over the finished one's cache and the steps captured on it
        # (those on its tables at the end: the cache grew once, dropping the earlier ones):
        # none is captured again (the drafter may choose other sizes this time, as its
        # measured payoff says: those are new)
        last = calls[-1][0]
        first = {key for table, key, _ in calls if table is last}
        calls.clear()
        assert run(lm, ids, params, drafter)[1] == want
        assert not first & {key for _, key, there in calls if not there}
        assert first & {key for _, key, there in calls if there}
        assert len(captured) > 1  # many graphs, one pool
        assert len(pools) == 1 and all(pool is pools[0] for _, pool in captured)


def test_graphed_steps_read_no_stale_slot_of_a_finished_reply(bundled_tokenizer):
    """Graphed steps attend over the cache's whole capacity behind a finfo.min mask; the
    tables come from the reply before. A NaN left in a slot this reply never writes would
    reach every row (score NaN + mask; probability 0 times value NaN): the reply decodes
    the tokens a fresh cache gives all the same."""
    lm = family_lm("llama", bundled_tokenizer)
    lm.target.graphed = True  # on a CPU the static steps run eagerly, over the same buffers
    ids = prompt(9, seed=7) * 3  # repeats: lookup drafts chains of several tokens
    params = SamplingParams(max_new_tokens=24)
    fresh = run(lm, ids, params, LookupDrafter())[1]
    (keys, values, _graphs), = lm.target._spare  # handed back when the reply ended
    end = len(ids) + params.max_new_tokens + 16  # past every slot a reply of these writes
    assert keys[0].shape[1] > end
    with torch.inference_mode():
        for table in (*keys, *values):
            table[:, end:] = float("nan")
    _text, got, stats = run(lm, ids, params, LookupDrafter())
    assert lm.target._spare[-1][0][0] is keys[0]  # the same tables, taken over and given back
    assert got == fresh and stats.step == "lean-graphs"
    assert sum(stats.drafted) > 0


def test_a_step_that_cannot_be_captured_decodes_eagerly(bundled_tokenizer, monkeypatch,
                                                         caplog):
    def refuse(*_args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.StaticStep, "__init__", refuse)
    lm = family_lm("llama", bundled_tokenizer)
    lm.target.graphed = True
    params = SamplingParams(max_new_tokens=12)
    want = run(family_lm("llama", bundled_tokenizer, step="eager"), prompt(8), params)[1]
    _text, got, stats = run(lm, prompt(8), params)
    assert got == want and stats.step == "lean-eager (graphs failed)"
    assert "not permitted when stream is capturing" in caplog.text


def test_a_graph_is_keyed_by_its_whole_step_plan_but_the_real_rows():
    """Eager, compiled and graphed steps follow one StepPlan; a captured graph serves every
    step whose plan differs only in how many of its padded rows are real."""
    import dataclasses

    from engine.lean.lean_target import StepPlan

    plan = StepPlan(rows=3, size=4, layers=range(0, 2), keep=False, graphed=True)
    assert plan.graph_key == dataclasses.replace(plan, rows=4).graph_key
    for change in (dict(size=8), dict(layers=range(0, 3)), dict(layers=range(1, 2)),
                   dict(keep=True)):
        assert dataclasses.replace(plan, **change).graph_key != plan.graph_key, change


def test_packages_are_keyed_by_the_layer_functions_own_source(monkeypatch):
    """No number to bump by hand: a change to the layer function's module (or to what the
    builder compiles it with) keys new packages, so a stale one is never loaded."""
    import inspect

    from engine.lean import layer

    before = compiled.package_folder("a model")
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource",
                        lambda obj: real(obj) + ("\n# changed" if obj is layer else ""))
    compiled.layout.cache_clear()
    try:
        assert compiled.package_folder("a model") != before
    finally:
        compiled.layout.cache_clear()


def test_low_bit_weights_carry_their_kernel_into_a_packages_key():
    """The kernel is chosen once, where weights are packed, and travels with them: a layer's
    pytree keeps it as static context (so packages of another kernel are other packages),
    and the builder's request (describe / rebuild, another process) keeps it."""
    from engine.lean.builder import Kind, describe, rebuild
    from engine.lean.layer import LayerWeights, Projection
    from engine.weights.lowbit import KERNELS, LowBitWeights
    from engine.weights.quant import LowBitLinear

    layer = LowBitLinear.from_linear(torch.nn.Linear(64, 32), "int8w", torch.device("cpu"))
    assert layer.weights.kernel in KERNELS
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), layer.weights.mm(x) + layer.bias)

    packed, scales = torch.zeros(32, 64, dtype=torch.int8), torch.ones(32, dtype=torch.bfloat16)

    def weights(kernel: str) -> LayerWeights:
        proj = Projection(LowBitWeights(packed, scales, kernel), None)
        return LayerWeights(norm_in=None, qkv=(proj,), q_norm=None, k_norm=None, o=proj,
                            norm_attn_out=None, norm_mlp_in=None, gate_up=(proj,), down=proj,
                            norm_mlp_out=None)

    assert Kind(weights("int8")).key != Kind(weights("blocks")).key
    assert len(Kind(weights("int8")).flat(weights("int8"))) == 8  # tensors only
    again = rebuild(describe(weights("int8")))
    assert again.o.weight.kernel == "int8" and again.o.weight.packed.dtype == torch.int8
