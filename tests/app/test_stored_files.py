"""Stored files a user or an older version left behind: corrupt conversations are named
once and skipped, bad settings fall back one line each and the app still starts, and a
written file's folder is synced after the rename. (The running server's side of this is in
tests/app/test_security.py.)"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from app.store import Settings, Store

pytestmark = pytest.mark.slow


def write_bad_store(root: Path) -> None:
    """Beside one good conversation: files that broke the list on older versions."""
    convs = root / "conversations"
    convs.mkdir(parents=True)
    good = {"id": "aaaa", "title": "Good one", "created": 1.0, "updated": 2.0,
            "messages": [{"role": "user", "content": "hello"}]}
    (convs / "aaaa.json").write_text(json.dumps(good))
    (convs / "bbbb.json").write_text("[]")
    (convs / "cccc.json").write_text(json.dumps({**good, "id": "cccc", "updated": "yesterday"}))
    numeric = {**good, "id": "dddd", "title": "Numbers", "messages": [
        {"role": "user", "content": "count"}, {"role": "assistant", "content": 42}]}
    (convs / "dddd.json").write_text(json.dumps(numeric))


def test_each_bad_conversation_is_named_once(tmp_path, caplog):
    write_bad_store(tmp_path)
    with caplog.at_level(logging.WARNING):
        ids = [c.id for c in Store(tmp_path).list()]
    assert sorted(ids) == ["aaaa", "dddd"]
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 2 and any("bbbb.json" in m for m in named)
    assert any("cccc.json" in m for m in named)
    caplog.clear()
    store = Store(tmp_path)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # the page lists them on every event: said once per file
            store.list()
    assert len(caplog.records) == 2


BAD_SETTINGS = {"quant": "bogus", "top_p": 7, "max_new_tokens": -5, "accel": "warp",
                "last_conversation": "../../etc/passwd", "temperature": float("inf")}


def test_bad_settings_fall_back_one_line_each(tmp_path, caplog):
    (tmp_path / "settings.json").write_text(json.dumps({**BAD_SETTINGS, "top_k": 5}))
    with caplog.at_level(logging.WARNING):
        s = Store(tmp_path).load_settings()
    defaults = Settings()
    for key in BAD_SETTINGS:
        assert getattr(s, key) == getattr(defaults, key), key
    assert s.top_k == 5  # a good value is kept
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(BAD_SETTINGS)
    for key in BAD_SETTINGS:
        assert any("settings.json" in line and key in line for line in lines), key


def test_the_app_starts_with_bad_settings(tmp_path, monkeypatch, bundled_tokenizer):
    """`serve` with quant "bogus" in settings.json used to exit: now it loads with Auto."""
    from app import service as service_module
    from tests.conftest import make_tiny_model

    (tmp_path / "settings.json").write_text(json.dumps(BAD_SETTINGS))
    specs = []
    tiny = make_tiny_model("llama-mha", bundled_tokenizer)
    monkeypatch.setattr("app.host.load_model", lambda spec, report=None:
                        specs.append(spec) or tiny)
    opened = service_module.Service.open(Store(tmp_path))
    assert opened.host.lm is tiny and specs[0].quant == "auto"


def test_the_folder_is_synced_after_the_rename(tmp_path, monkeypatch):
    import stat

    from app import store as store_module

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
                        or real(fd))
    store_module.atomic_write_text(tmp_path / "x.json", "{}")
    assert synced[-1] is True  # the folder, after the file


def test_a_settings_file_that_is_replaced_is_kept_and_unknown_keys_stay(tmp_path, caplog):
    store = Store(tmp_path)
    store.settings_path.write_text(json.dumps({**BAD_SETTINGS, "top_k": 5, "newer": [1, 2]}))
    with caplog.at_level(logging.WARNING):
        store.remember(model="org/model")  # what the app does at start-up
    saved = json.loads(store.settings_path.read_text())
    assert saved["newer"] == [1, 2] and saved["model"] == "org/model" and saved["top_k"] == 5
    kept = list(tmp_path.glob("settings.json.bad-*"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["quant"] == "bogus"
    assert any("kept as settings.json.bad-" in r.getMessage() for r in caplog.records)
    store.remember(top_k=6)  # a clean file is not copied again
    assert len(list(tmp_path.glob("settings.json.bad-*"))) == 1
    store.settings_path.write_text("{not json")
    store.remember(top_k=7)
    copies = [json.loads(p.read_text()) if p.read_text().startswith("{\"") else p.read_text()
              for p in tmp_path.glob("settings.json.bad-*")]
    assert len(copies) == 2 and "{not json" in copies and store.load_settings().top_k == 7


def test_a_value_a_page_sends_is_refused_not_saved(tmp_path):
    from app.settings_rules import SettingError

    store = Store(tmp_path)
    store.remember(temperature=0.5)
    for key, value in (("temperature", float("nan")), ("top_p", float("inf")),
                       ("max_new_tokens", 10**9), ("acceptance", "greedy"), ("system", "\ud800")):
        with pytest.raises(SettingError, match=key):
            store.remember(**{key: value})
    assert "NaN" not in store.settings_path.read_text()  # settings.json stays JSON
    assert store.load_settings().temperature == 0.5
