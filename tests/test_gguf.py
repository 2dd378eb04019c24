"""GGUF models: a tiny random Llama written to GGUF here (with the `gguf` package) loads through
`--model FILE.gguf` and decodes exactly like the same weights from safetensors; bad files get
one-line errors; the converted folder is reused."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import gguf as qd_gguf
from engine.chat import conversation, encode
from engine.config import ModelSpec, SamplingParams
from engine.errors import ModelLoadError
from engine.generate import run
from engine.loading import bundled_gguf, load_model, resolve_folder

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
PROMPT = "Tell me a story about a lighthouse."
# HF llama parameter names -> GGUF tensor names (llama.cpp's convert script does the same).
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
TOKENIZER_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.merges", "tokenizer.chat_template")


@functools.lru_cache(maxsize=1)
def tokenizer_fields() -> dict:
    """The bundled model's tokenizer fields (tokens, types, merges, chat template)."""
    from gguf import GGUFReader

    reader = GGUFReader(bundled_gguf())
    return {key: reader.get_field(key).contents() for key in TOKENIZER_FIELDS}


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


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved); transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(path: Path, model, vocab: dict, arch: str = "llama", odd_type=False,
               qtype: str | None = None) -> Path:
    """`model`'s fp32 weights and the bundled tokenizer as a GGUF file; `odd_type` stores one
    tensor as Q8_1, a type llama.cpp uses only internally (gguf cannot dequantize it);
    `qtype` (e.g. "Q4_0") stores every layer matrix in that type and the token table and head
    in Q8_0, as llama.cpp's own 4-bit files keep them."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    cfg = model.config
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope))
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab["tokenizer.ggml.tokens"])
    w.add_token_types(vocab["tokenizer.ggml.token_type"])
    w.add_token_merges(vocab["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(vocab["tokenizer.chat_template"])
    for name, tensor in _gguf_tensors(model).items():
        if odd_type and name == "blk.0.ffn_up.weight":
            rows, cols = tensor.shape  # Q8_1: blocks of 32 values in 40 bytes
            w.add_tensor(name, np.zeros((rows, cols // 32 * 40), np.uint8),
                         raw_dtype=GGMLQuantizationType.Q8_1)
            continue
        kind = _stored_type(name, tensor, qtype)
        if kind is None:
            w.add_tensor(name, tensor)
        else:
            kind = GGMLQuantizationType[kind]
            w.add_tensor(name, quants.quantize(tensor, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _stored_type(name: str, tensor: np.ndarray, qtype: str | None) -> str | None:
    """The GGUF type `name` is written in under `qtype` (None: float32)."""
    if qtype is None or tensor.ndim != 2:
        return None
    return "Q8_0" if name in ("token_embd.weight", "output.weight") else qtype


def _gguf_tensors(model) -> dict[str, np.ndarray]:
    cfg = model.config
    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"],
           "output_norm.weight": state["model.norm.weight"],
           "output.weight": state["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in LAYER_NAMES.items():
            weight = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                weight = _permute(weight, cfg.num_attention_heads)
            elif gg == "attn_k":
                weight = _permute(weight, cfg.num_key_value_heads)
            out[f"blk.{i}.{gg}.weight"] = weight
    return out


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
