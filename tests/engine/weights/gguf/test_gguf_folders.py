"""GGUF models other apps downloaded, in folders laid out like LM Studio's and Ollama's (built
here): listed with their names (Ollama's from its manifests, not blob hashes), size and a
memory estimate; an Ollama blob opens like any GGUF file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from app import catalog
from app.model_folders import ModelFolders, find_models, ollama_name
from engine.config import ModelSpec
from engine.model.loading import load_model
from engine.weights import gguf as qd_gguf


def small_gguf(path: Path, arch: str = "llama") -> Path:
    """A header-complete GGUF with a toy tokenizer (enough to be listed, not to chat)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "d"])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def ollama_store(root: Path, models: dict[tuple[str, ...], Path]) -> dict[str, Path]:
    """Ollama's layout: blobs/sha256-<hex> and manifests/<registry>/<namespace>/<name>/<tag>."""
    blobs = {}
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for parts, source in models.items():
        data = source.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        blob = root / "blobs" / f"sha256-{digest}"
        blob.write_bytes(data)
        license_blob = root / "blobs" / f"sha256-{'0' * 64}"
        license_blob.write_text("Apache-2.0")
        manifest = root / "manifests" / Path(*parts)
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps({
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                       "digest": f"sha256:{'1' * 64}", "size": 10},
            "layers": [{"mediaType": "application/vnd.ollama.image.license",
                        "digest": f"sha256:{'0' * 64}", "size": 10},
                       {"mediaType": "application/vnd.ollama.image.model",
                        "digest": f"sha256:{digest}", "size": len(data)}]}))
        blobs[ollama_name(Path(*parts))] = blob
    return blobs


@pytest.fixture
def folders(tmp_path):
    """LM Studio and Ollama folders with a few models, a broken manifest and a stray file."""
    home = tmp_path / "home"
    lms = home / ".lmstudio" / "models"
    for rel in ("lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf", "bartowski/Odd-GGUF/odd.gguf"):
        (lms / rel).parent.mkdir(parents=True)
    small_gguf(lms / "lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf")
    small_gguf(lms / "bartowski/Odd-GGUF/odd.gguf", arch="rwkv6")
    (lms / "lmstudio-community/Tiny-GGUF/README.md").write_text("not a model")
    store = home / ".ollama" / "models"
    blobs = ollama_store(store, {
        ("registry.ollama.ai", "library", "tinyllama", "latest"): small_gguf(tmp_path / "t.gguf"),
        ("hf.co", "someone", "Tiny-GGUF", "Q8_0"): small_gguf(tmp_path / "h.gguf"),
    })
    broken = store / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    return ModelFolders.default(home=home), blobs


def test_finds_lmstudio_files_and_ollama_models_by_name(folders):
    where, blobs = folders
    found = find_models(where)
    names = [(m.app, m.name) for m in found]
    assert names == [("LM Studio", "bartowski/Odd-GGUF/odd.gguf"),
                     ("LM Studio", "lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf"),
                     ("Ollama", "hf.co/someone/Tiny-GGUF:Q8_0"),
                     ("Ollama", "tinyllama:latest")]
    ollama = {m.name: m for m in found if m.app == "Ollama"}
    assert ollama["tinyllama:latest"].path == blobs["tinyllama:latest"]
    assert all(m.size == m.path.stat().st_size for m in found)


def test_listing_shows_size_and_memory_never_the_hash(folders):
    where, _blobs = folders
    listed = dict(catalog.gguf_models(where))
    labels = list(listed)
    assert any(label.startswith("Ollama: tinyllama:latest · ") for label in labels)
    assert all("sha256" not in label for label in labels)
    tiny = next(label for label in labels if "Tiny-Q8_0" in label)
    assert "KB file" in tiny and "to run" in tiny
    odd = next(label for label in labels if "odd.gguf" in label)
    assert "architecture 'rwkv6' is not supported" in odd
    estimate = catalog.memory_estimate(ModelSpec(listed[tiny]))
    assert estimate.startswith("GGUF llama (F32)") and "needed" in estimate


def test_missing_folders_list_nothing(tmp_path):
    assert find_models(ModelFolders((tmp_path / "lms",), (tmp_path / "ollama",))) == []


def test_ollama_models_env_is_searched(tmp_path, monkeypatch):
    store = tmp_path / "elsewhere"
    ollama_store(store, {("registry.ollama.ai", "me", "mine", "v1"):
                         small_gguf(tmp_path / "m.gguf")})
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    found = find_models(ModelFolders.default(home=tmp_path / "nobody"))
    assert [m.name for m in found][:1] == ["me/mine:v1"]


def test_an_ollama_blob_opens_like_a_gguf_file(tmp_path, monkeypatch):
    """The blob has no extension: its header, not its name, says it is GGUF."""
    from bench.gguf_writer import tokenizer_fields, write_gguf
    from tests.engine.weights.gguf.test_gguf import tiny_llama

    monkeypatch.setattr(qd_gguf, "cache_dir", lambda: tmp_path / "cache")
    source = write_gguf(tmp_path / "src.gguf", tiny_llama(), tokenizer_fields())
    blobs = ollama_store(tmp_path / "ollama", {
        ("registry.ollama.ai", "library", "tiny", "latest"): source})
    (tmp_path / "src.gguf").unlink()  # only the blob is left
    lm = load_model(ModelSpec(str(blobs["tiny:latest"]), "fp32"))
    assert lm.model.config.model_type == "llama" and lm.tokenizer.chat_template
