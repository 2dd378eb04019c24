"""The Models tab's side of the service: size figures before loading, hub downloads with
progress and one-line failures, and the model flags the app shares with every command."""

from __future__ import annotations

import shutil

import pytest

from engine.config import ModelSpec
from engine.errors import ModelLoadError


def test_models_tab_figures_before_loading(tiny, tmp_path):
    from app import catalog
    from engine.weights import memory_fit

    folder = tmp_path / "tiny-folder"
    tiny.model.save_pretrained(folder)
    params = sum(p.numel() for p in tiny.model.parameters())
    # tied embeddings are stored once
    assert memory_fit.read_checkpoint(folder).parameters == params
    assert catalog.estimate_bytes(1_000_000, "nf4") < catalog.estimate_bytes(1_000_000, "bf16") \
        < catalog.estimate_bytes(1_000_000, "fp32")
    line = catalog.memory_estimate(ModelSpec(source=str(folder), quant="fp32"))
    assert line.startswith(f"{params / 1e6:,.0f} M parameters (f32) · fp32 on cpu"), line
    assert "free" in line
    assert "unknown until downloaded" in catalog.memory_estimate(ModelSpec(source="org/absent"))
    hub = tmp_path / "hub"
    assert catalog.cached_models(hub) == []  # no cache at all
    snapshot = hub / "models--org--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(folder, snapshot)
    (hub / "models--org--tiny" / "refs").mkdir()
    (hub / "models--org--tiny" / "refs" / "main").write_text("0" * 40)
    assert catalog.cached_models(hub) == ["org/tiny"]


def test_a_source_that_names_nothing_says_so_before_loading(tmp_path):
    from types import SimpleNamespace

    from app import catalog
    from app.ui.models import ModelsTab

    tab = ModelsTab.__new__(ModelsTab)  # its size line alone, with no model loaded
    tab.service = SimpleNamespace(host=SimpleNamespace(current=None))
    missing = tmp_path / "no" / "such-model"
    for source, why in ((str(missing), f"model folder not found: {missing}"),
                        (f"{missing}.gguf", f"GGUF file not found: {missing}.gguf"),
                        ("justaword", "is neither a local folder, a GGUF file nor")):
        with pytest.raises(ModelLoadError, match=why):
            catalog.memory_estimate(ModelSpec(source=source))
        shown = tab.memory(source, "auto")
        assert why in shown and "until downloaded" not in shown
    assert "until downloaded" in catalog.memory_estimate(ModelSpec(source="org/absent"))


def test_download_progress_reports_bytes_on_disk(monkeypatch, tmp_path):
    """The hub client drives two byte bars; the one with the files' sizes is reported."""
    from app import catalog

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, tqdm_class=None):
        network = tqdm_class(desc="Downloading bytes", total=0, unit="B")
        disk = tqdm_class(desc="Reconstructing", total=4096, unit="B")
        files = tqdm_class(desc="Fetching 2 files", total=2)
        for _ in range(4):
            network.update(1500)
            disk.update(1024)
        files.update(2)
        return str(tmp_path)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    seen = []
    assert catalog.download("org/model", None, lambda m, f: seen.append((m, f))) == tmp_path
    assert [f for _, f in seen] == [0.25, 0.5, 0.75, 1.0]
    assert seen[-1][0] == "downloading org/model: 4 KB of 4 KB"


def test_hub_model_is_downloaded_with_progress_then_loaded(service, tiny, tmp_path, monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    snapshot = tmp_path / "snapshot"
    tiny.model.save_pretrained(snapshot)
    tiny.tokenizer.save_pretrained(snapshot)
    cached = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None,
                               local_files_only=False, tqdm_class=None):
        if local_files_only and not cached:
            raise LocalEntryNotFoundError("not in the cache")
        if not local_files_only:  # the download, driving a byte bar as the hub client does
            bar = tqdm_class(desc="Reconstructing", total=2048, unit="B")
            bar.update(1024)
            bar.update(1024)
            cached.append(repo_id)
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    reports = []
    lm = service.host.load_model(ModelSpec(source="org/tiny", quant="fp32"), reports.append)
    assert cached == ["org/tiny"]  # downloaded once, then loaded from the cache
    assert [(p.stage, p.fraction) for p in reports] == [
        ("download", 0.5), ("download", 1.0), ("load", 0.0), ("done", 1.0)]
    assert service.host.lm is lm and lm.model_id == "org/tiny"
    assert service.store.load_settings().model == "org/tiny"


def test_a_failed_download_says_why_in_one_line_and_is_not_tried_again(service, tiny,
                                                                      monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    tries = []

    def failing_snapshot_download(repo_id, revision=None, allow_patterns=None,
                                  local_files_only=False, tqdm_class=None):
        if local_files_only:
            raise LocalEntryNotFoundError("not in the cache")
        tries.append(repo_id)
        raise ConnectionError("connection reset by peer\nretry later")

    monkeypatch.setattr("huggingface_hub.snapshot_download", failing_snapshot_download)
    with pytest.raises(ModelLoadError, match="could not download org/tiny: ConnectionError") \
            as err:
        service.host.load_model(ModelSpec(source="org/tiny", quant="fp32"))
    assert "\n" not in str(err.value) and tries == ["org/tiny"]  # once, not again by loading
    assert service.host.lm is tiny  # the old model stays


def test_the_app_takes_the_model_flags_every_command_takes(monkeypatch):
    from app.cli import main as cli_main

    got = []
    monkeypatch.setattr("app.ui.launch.launch", lambda options, block=True: got.append(options))
    assert cli_main(["serve", "--model", "org/repo", "--gguf-file", "m.gguf", "--quant", "int8",
                     "--device", "cpu"]) == 0
    assert got[-1].model == ModelSpec("org/repo:m.gguf", "int8", device="cpu")
    assert cli_main(["serve"]) == 0 and got[-1].model is None  # the last model used
