"""Shared fixtures: tiny random models built from configs here, and the bundled model.

Every test runs on the CPU, seeded, without network. Nothing a test writes reaches the
user's folders: the data folder is a temporary one per test, and the cache (the converted
bundled model, quantization choices, features, compiled steps, inductor's and Gradio's own
files) one temporary folder for the session. The session fails if the user's folders
changed while it ran (tests/home_guard.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from tests import home_guard

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# No compiled step is built behind the tests (a minute of every core each): the tests that
# build one ask for it (tests/engine/lean/test_lean.py, tests/app/test_compiled_chat.py).
os.environ["QUICKDRAFT_NO_STEP_BUILDS"] = "1"
# Before torch is imported (inductor reads some folders once) and anything asks for a
# folder; child processes (the launcher's commands) inherit these.
_SESSION_DIR = tempfile.mkdtemp(prefix="quickdraft-tests-")
home_guard.isolate(_SESSION_DIR)
_USER_FOLDERS = home_guard.snapshot()

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    changed = home_guard.changes(_USER_FOLDERS)
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)
    if changed:
        print("\nthe suite changed the user's folders:\n  " + "\n  ".join(changed[:20]))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

from engine.config import ModelSpec  # noqa: E402
from engine.model.loading import load_model, wrap_model  # noqa: E402

TINY_CONFIGS = {
    # Llama-style, multi-head attention, tied embeddings
    "llama-mha": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    # grouped-query attention
    "llama-gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # untied LM head
    "llama-untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    # Qwen2 family (biases on q/k/v)
    "qwen2": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
}


@pytest.fixture(autouse=True)
def _isolated_data_dir(tmp_path_factory, monkeypatch):
    """Accelerators, conversations and settings written by a test go to its own temp
    folder, so no test sees another's checkpoints."""
    monkeypatch.setenv("QUICKDRAFT_DATA_DIR", str(tmp_path_factory.mktemp("quickdraft-data")))
    # the accelerators shipped for the bundled model stay out of sight unless a test asks
    monkeypatch.setenv("QUICKDRAFT_SHIPPED_DIR", str(tmp_path_factory.mktemp("shipped")))


@pytest.fixture(scope="session")
def bundled_tokenizer():
    """The bundled model's tokenizer (ChatML template, 49k vocabulary)."""
    from transformers import AutoTokenizer

    from engine.model.loading import bundled_folder

    return AutoTokenizer.from_pretrained(bundled_folder())


def make_tiny_model(name: str, tokenizer, vocab_size: int | None = None, num_layers: int = 4,
                    seed: int = 0):
    """A LoadedModel with random weights from TINY_CONFIGS[name], fp32 on the CPU.

    vocab_size defaults to the tokenizer's so decoded text is meaningful; statistical
    tests pass a tiny vocabulary instead.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    family, extra = TINY_CONFIGS[name]
    config = AutoConfig.for_model(
        family,
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        # Larger than the default 0.02 so the layers, not the residual copy of the input
        # embedding, decide the output: replies vary instead of repeating one token.
        initializer_range=0.2,
        **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return wrap_model(model, tokenizer, ModelSpec(source=f"tiny-{name}"), f"tiny-{name}", "fp32")


@pytest.fixture(params=sorted(TINY_CONFIGS))
def tiny_lm(request, bundled_tokenizer):
    """Each tiny config in turn."""
    return make_tiny_model(request.param, bundled_tokenizer)


@pytest.fixture(scope="session")
def bundled_lm():
    """The bundled SmolLM2-135M-Instruct in fp32 (exactness tests)."""
    return load_model(ModelSpec(quant="fp32"))


@pytest.fixture
def one_thread():
    """Tiny models run thousands of small ops: one thread is faster and immune to other
    processes' threads (use with pytestmark = pytest.mark.usefixtures("one_thread"))."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# A small tree every Medusa checkpoint here can fill (depth 2: trained heads number >= 2).
FORCED_TREE = [(0,), (1,), (0, 0), (1, 0)]


def drafting(lm, drafter):
    """`drafter`, or (when calibration switched it off, so it would decode plainly) its trained
    weights with a forced tree / schedule: exactness checks then hold while drafting."""
    from engine.decode.tree import build_tree
    from engine.drafters.kangaroo import KangarooDrafter
    from engine.drafters.medusa import MedusaDrafter

    if isinstance(drafter, KangarooDrafter) and drafter.off:
        return drafter.with_schedule(0.0, 3)
    if drafter.pays_off or not isinstance(drafter, MedusaDrafter):
        return drafter
    forced = build_tree(FORCED_TREE, drafter.heads.settings.num_heads)
    return MedusaDrafter(lm, drafter.heads, forced)


def assert_exact_while_drafting(lm, prompt: list[int], params, drafter) -> None:
    """Greedy with `drafter` gives plain decoding's tokens, and it did draft."""
    from engine.decode.generate import run

    _t, ids, stats = run(lm, prompt, params, drafting(lm, drafter))
    assert ids == run(lm, prompt, params)[1]
    assert sum(stats.drafted) > 0, "the drafter never drafted: exactness held trivially"


@pytest.fixture
def tiny(bundled_tokenizer):
    """A tiny random Llama (multi-head attention) for service-level tests."""
    return make_tiny_model("llama-mha", bundled_tokenizer)


@pytest.fixture
def service(tmp_path, tiny):
    """The app's service over `tiny`, with its data in a temporary folder."""
    from app.service import Service
    from app.store import Store

    return Service(Store(tmp_path / "data"), tiny)
