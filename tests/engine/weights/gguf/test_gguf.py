"""GGUF models: a tiny random Llama written to GGUF here (with the `gguf` package) loads through
`--model FILE.gguf` and decodes exactly like the same weights from safetensors; bad files get
one-line errors; the converted folder is reused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from bench.gguf_writer import tokenizer_fields, write_gguf
from engine.config import ModelSpec, SamplingParams
from engine.decode.chat_template import conversation, encode
from engine.decode.generate import run
from engine.errors import ModelLoadError
from engine.model.loading import load_model, resolve_folder
from engine.weights import gguf as qd_gguf
from tests.paths import ROOT

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
PROMPT = "Tell me a story about a lighthouse."
@pytest.fixture(scope="module")
def vocab():
    return tokenizer_fields()


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama()


def tiny_llama():
    """A random 2-layer Llama (GQA, untied head) over the bundled 49k vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, tie_word_embeddings=False,
                                  bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory, tiny_model, vocab, bundled_tokenizer):
    """The same weights twice: a GGUF file and a safetensors folder."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    folder = root / "safetensors"
    tiny_model.save_pretrained(folder)
    bundled_tokenizer.save_pretrained(folder)
    return write_gguf(root / "tiny-llama.gguf", tiny_model, vocab), folder


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    """Converted GGUF folders go to a temporary cache (the bundled model keeps its own)."""
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture
def gguf_cache(cache_home, monkeypatch):
    monkeypatch.setattr(qd_gguf, "cache_dir", lambda: cache_home)
    return cache_home


def _greedy(lm) -> list[int]:
    ids = encode(lm.tokenizer, conversation(PROMPT))
    return run(lm, ids, GREEDY)[1]


def test_gguf_file_decodes_like_the_same_weights_from_safetensors(tiny_files, gguf_cache):
    gguf_path, folder = tiny_files
    messages = []
    from_gguf = load_model(ModelSpec(str(gguf_path), "fp32"), messages.append)
    reference = load_model(ModelSpec(str(folder), "fp32"))
    assert "first time only" in messages[0] and "converted" in messages[-1]
    assert from_gguf.model_id == str(gguf_path.resolve())
    # the tokenizer converted from GGUF metadata encodes the chat like the original one
    assert (encode(from_gguf.tokenizer, conversation(PROMPT))
            == encode(reference.tokenizer, conversation(PROMPT)))
    assert from_gguf.eos_ids == reference.eos_ids
    assert _greedy(from_gguf) == _greedy(reference)
    assert from_gguf.fingerprint == reference.fingerprint  # accelerators attach alike


def test_converted_folder_is_reused(tiny_files, gguf_cache):
    gguf_path, _folder = tiny_files
    first, _ = resolve_folder(ModelSpec(str(gguf_path)))
    messages = []
    again, _ = resolve_folder(ModelSpec(str(gguf_path)), messages.append)
    assert again == first and messages == []  # no second conversion
    assert first.parent == gguf_cache / "models" / "gguf"
    assert first.name.startswith("tiny-llama-")
    assert not list(first.parent.glob("*.tmp-*"))


def test_two_conversions_at_once_both_end_with_the_folder(tiny_files, tmp_path, monkeypatch):
    """The first start converts the bundled file while a page event (the Models tab's size
    estimate) asks for the same folder: neither may pull the other's files away."""
    from transformers import AutoModelForCausalLM

    gguf_path, _folder = tiny_files
    target = tmp_path / "models" / "tiny"
    errors, both_read = [], threading.Barrier(2, timeout=60)
    read = AutoModelForCausalLM.from_pretrained

    def read_then_wait(*args, **kwargs):  # both have read the file before either saves
        model = read(*args, **kwargs)
        both_read.wait()
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", read_then_wait)

    def convert():
        try:
            qd_gguf.convert(gguf_path, target)
        except Exception as exc:  # noqa: BLE001 - the test reports whatever failed
            errors.append(exc)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert (target / "model.safetensors").is_file() and (target / "config.json").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny"]  # no tmp left


def test_chat_command_takes_a_gguf_file(tiny_files, gguf_cache):
    gguf_path, folder = tiny_files
    env = {**os.environ, "QUICKDRAFT_NO_BOOTSTRAP": "1", "HF_HUB_OFFLINE": "1",
           "QUICKDRAFT_CACHE_DIR": str(gguf_cache)}
    out = subprocess.run([sys.executable, str(ROOT / "launcher.py"), "chat", "--prompt", PROMPT,
                          "--model", str(gguf_path), "--quant", "fp32", "--max-new-tokens",
                          "16", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    reply = json.loads(out.stdout)
    assert reply["token_ids"] == _greedy(load_model(ModelSpec(str(folder), "fp32")))


def test_not_gguf_is_refused_in_one_line(tmp_path, gguf_cache):
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model")
    with pytest.raises(ModelLoadError, match="is not a GGUF file") as err:
        load_model(ModelSpec(str(text)))
    assert "\n" not in str(err.value) and str(text) in str(err.value)


def test_truncated_gguf_is_refused(tiny_files, tmp_path, gguf_cache):
    data = tiny_files[0].read_bytes()
    for keep in (len(data) // 2, 200):  # cut in the weights, then in the header
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(ModelLoadError, match="truncated") as err:
            load_model(ModelSpec(str(cut)))
        assert "\n" not in str(err.value)


def test_unsupported_architecture_is_named(tiny_model, vocab, tmp_path, gguf_cache):
    odd = write_gguf(tmp_path / "odd.gguf", tiny_model, vocab, arch="rwkv6")
    with pytest.raises(ModelLoadError, match="architecture 'rwkv6' is not supported") as err:
        load_model(ModelSpec(str(odd)))
    assert "llama" in str(err.value) and "\n" not in str(err.value)


def test_unsupported_tensor_type_is_named(tiny_model, vocab, tmp_path, gguf_cache):
    odd = write_gguf(tmp_path / "odd-type.gguf", tiny_model, vocab, odd_type=True)
    with pytest.raises(ModelLoadError, match="tensor type Q8_1 is not supported") as err:
        load_model(ModelSpec(str(odd)))
    assert "Q4_K" in str(err.value) and "\n" not in str(err.value)


def test_missing_file_and_hub_gguf_ids(tmp_path, gguf_cache):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(ModelSpec(str(tmp_path / "absent.gguf")))
    assert qd_gguf.parse_hub("owner/repo:model.Q4_K_M.gguf") == ("owner/repo",
                                                                  "model.Q4_K_M.gguf")
    assert qd_gguf.parse_hub("owner/repo:sub/model.gguf") == ("owner/repo", "sub/model.gguf")
    assert qd_gguf.parse_hub("./owner/repo:x.gguf") is None
    assert qd_gguf.parse_hub("owner/repo") is None
    # offline (tests never touch the network): one line, naming the file
    with pytest.raises(ModelLoadError, match="owner/repo:model.gguf") as err:
        load_model(ModelSpec("owner/repo:model.gguf"))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_bundled_model_converts_as_before(tmp_path, monkeypatch, bundled_lm):
    """The bundled GGUF, converted afresh into an empty cache, decodes like the cached one."""
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path))
    fresh = load_model(ModelSpec(quant="fp32"))
    assert (tmp_path / "models" / "SmolLM2-135M-Instruct" / "model.safetensors").is_file()
    assert fresh.fingerprint == bundled_lm.fingerprint
    assert _greedy(fresh) == _greedy(bundled_lm)


def test_models_tab_load_reports_the_conversion(tiny_files, tmp_path, monkeypatch):
    """Loading a GGUF the way the Models tab does: the job hears about the conversion."""
    from app.service import Service
    from app.store import Store

    monkeypatch.setattr(qd_gguf, "cache_dir", lambda: tmp_path / "cache")
    service = Service(Store(tmp_path / "data"))
    job = service.host.start_load(ModelSpec(str(tiny_files[0]), "fp32"))
    seen = []
    while job.running:
        if job.progress is not None and job.progress.message not in seen:
            seen.append(job.progress.message)
        time.sleep(0.01)
    assert job.state == "done", job.error
    assert any("first time only" in m for m in seen)
    assert service.host.lm.model_id == str(tiny_files[0].resolve())
    assert service.store.load_settings().model == str(tiny_files[0])


def test_gguf_file_flag_joins_repo_and_file():
    from app.commands.common import gguf_source
    from engine.errors import QuickdraftError

    assert gguf_source("owner/repo", "model.Q4_K_M.gguf") == "owner/repo:model.Q4_K_M.gguf"
    assert gguf_source("owner/repo", None) == "owner/repo"
    with pytest.raises(QuickdraftError, match="--gguf-file goes with"):
        gguf_source("./folder/x.gguf", "model.gguf")
