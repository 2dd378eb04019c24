"""GGUF paths the bundled-model test does not reach, on tiny files written here: quantized
tensors, a file that changes under its converted folder, the hub's errors, and the one
internal transformers name engine/weights/gguf.py relies on."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from bench.gguf_writer import gguf_tensors, write_gguf
from engine.config import ModelSpec
from engine.errors import ModelLoadError
from engine.model.loading import load_model, resolve_folder
from engine.weights import gguf as qd_gguf
from tests.engine.weights.gguf.test_gguf import tiny_llama

QUANTIZED = {"blk.0.ffn_up.weight": "Q8_0", "blk.1.ffn_down.weight": "Q4_0",
             "blk.0.ffn_gate.weight": "Q5_0"}
HF_NAMES = {"blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
            "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight",
            "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight"}


@pytest.fixture(scope="module")
def vocab():
    from bench.gguf_writer import tokenizer_fields

    return tokenizer_fields()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(qd_gguf, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache"


def _write_quantized(path, model, vocab):
    """The tiny model with three MLP weights stored quantized (Q8_0, Q4_0, Q5_0); returns
    what gguf's own dequantizer makes of them, the reference for the loaded weights."""
    from gguf import GGMLQuantizationType, quants

    want = {}
    import gguf

    real_add = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, *args, **kwargs):
        if name in QUANTIZED:
            qtype = GGMLQuantizationType[QUANTIZED[name]]
            data = quants.quantize(tensor, qtype)
            want[name] = quants.dequantize(data, qtype)
            return real_add(self, name, data, raw_dtype=qtype)
        return real_add(self, name, tensor, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
        write_gguf(path, model, vocab)
    return want


def test_quantized_tensors_load_as_gguf_dequantizes_them(tmp_path, vocab, cache):
    model = tiny_llama()
    want = _write_quantized(tmp_path / "tiny-q.gguf", model, vocab)
    assert sorted(qd_gguf.inspect(tmp_path / "tiny-q.gguf").tensor_types) == \
        ["F32", "Q4_0", "Q5_0", "Q8_0"]
    lm = load_model(ModelSpec(str(tmp_path / "tiny-q.gguf"), "fp32"))
    state = lm.model.state_dict()
    for name, hf in HF_NAMES.items():
        original = model.state_dict()[hf]
        assert torch.equal(state[hf], torch.from_numpy(want[name]))  # exactly gguf's values
        assert not torch.equal(state[hf], original)  # really quantized, not stored in fp32
    plain = gguf_tensors(model)["blk.1.ffn_up.weight"]
    assert np.array_equal(state["model.layers.1.mlp.up_proj.weight"].numpy(), plain)


def test_a_changed_file_is_converted_again(tmp_path, vocab, cache):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_llama(), vocab)
    first, _ = resolve_folder(ModelSpec(str(path)))
    other = tiny_llama()
    with torch.no_grad():
        other.model.norm.weight.mul_(-1.0)  # a different model under the same name and size
    write_gguf(path, other, vocab)
    messages = []
    second, _ = resolve_folder(ModelSpec(str(path)), messages.append)
    assert second != first and any("first time only" in m for m in messages)
    lm = load_model(ModelSpec(str(path), "fp32"))
    assert torch.equal(lm.model.state_dict()["model.norm.weight"], other.model.norm.weight)


def _status(code: int) -> httpx.Response:
    return httpx.Response(code, request=httpx.Request("GET", "https://huggingface.co/x"))


@pytest.mark.parametrize("error, message", [
    ("gated", "is gated: accept its licence and log in"),
    ("offline", "is not in the Hugging Face cache and the hub cannot be reached"),
    ("no file", "has no file 'm.gguf'"),
    ("no repo", "no model 'org/repo' on the Hugging Face hub"),
    ("no revision", "no model 'org/repo' on the Hugging Face hub"),
    ("network", "could not download org/repo:m.gguf: ConnectError: refused"),
])
def test_hub_errors_become_one_line_each(monkeypatch, error, message):
    import huggingface_hub
    from huggingface_hub import errors

    raised = {
        "gated": errors.GatedRepoError("gated", response=_status(403)),
        "offline": errors.LocalEntryNotFoundError("offline"),
        "no file": errors.EntryNotFoundError("missing"),
        "no repo": errors.RepositoryNotFoundError("missing", response=_status(404)),
        "no revision": errors.RevisionNotFoundError("missing", response=_status(404)),
        "network": httpx.ConnectError("refused\nmore"),
    }[error]

    def download(local_files_only=False, **_kwargs):
        if local_files_only:
            raise errors.LocalEntryNotFoundError("not cached")
        raise raised

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(ModelLoadError) as info:
        qd_gguf.hub_file("org/repo", "m.gguf")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_internal_transformers_name_engine_gguf_relies_on_is_still_there():
    """engine.weights.gguf.supported_architectures reads this internal transformers module (there is
    no public list); an upgrade that moves it fails here, by name."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    assert {"llama", "qwen2"} <= set(GGUF_SUPPORTED_ARCHITECTURES)
    assert "llama" in qd_gguf.supported_architectures()
    assert {"Q4_K", "Q6_K", "Q8_0"} <= set(qd_gguf.supported_types())  # public gguf classes
