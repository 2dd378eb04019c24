"""Stored files no page load may trip on: a conversation nested too deeply to parse, one
holding "\\ud800" escapes or a list where a method name belongs, a link in the conversations
folder, a FIFO in its place: each is skipped with one line, never listed, never opened
(not even as the last conversation), and the page restores itself. And what the page may
store: system prompts capped, empty conversations bounded, the trash read as carefully."""

from __future__ import annotations

import json
import logging
import os
import threading

import gradio as gr
import pytest

from app.service import Service
from app.settings_rules import SYSTEM_CHARS, SettingError
from app.store import EMPTY_KEEP, Store, StoreError
from app.ui.chat_tab import ChatTab

GOOD = {"title": "Good one", "created": 1.0, "updated": 2.0,
        "messages": [{"role": "user", "content": "hello"},
                     {"role": "assistant", "content": "hi", "accel": "auto:lookup",
                      "stats": {"tokens": 1, "steps": 0, "tokens_per_s": 3.5}}]}


@pytest.fixture
def tab(tmp_path, tiny):
    with gr.Blocks():
        return ChatTab(Service(Store(tmp_path / "data"), tiny))


def _write(store: Store, conv_id: str, text: str | bytes) -> None:
    store.conv_dir.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    (store.conv_dir / f"{conv_id}.json").write_bytes(data)


HOSTILE = {
    "deep": "[" * 200_000 + "]" * 200_000,
    "deepobj": json.dumps({**GOOD, "title": "x"})[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}",
    "surrogate": json.dumps(GOOD).replace('"hello"', '"\\ud800"'),
    "surrokey": json.dumps(GOOD).replace('"title"', '"\\udfff", "title"', 1).replace(
        '"\\udfff", ', '"\\udfff": 1, ', 1),
    "accel": json.dumps({**GOOD, "messages": [{"role": "assistant", "content": "a",
                                               "accel": ["x"]}]}),
    "stats": json.dumps({**GOOD, "messages": [{"role": "assistant", "content": "a",
                                               "stats": {"tokens_per_s": "fast"}}]}),
    "model": json.dumps({**GOOD, "messages": [{"role": "assistant", "content": "a",
                                               "model": 7}]}),
    "digits": json.dumps(GOOD).replace('"created": 1.0', '"created": ' + "9" * 5000),
    "latin1": json.dumps(GOOD, ensure_ascii=False).replace("hello", "h\u00e9llo").encode(
        "latin-1"),  # not UTF-8
    "raw-surrogate": json.dumps(GOOD, ensure_ascii=False).replace("hello", "\ud800"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_conversation_is_skipped_and_the_page_restores(tab, kind, caplog):
    store = tab.service.store
    _write(store, "aaaa", json.dumps(GOOD))
    _write(store, "bbbb", HOSTILE[kind])
    store.remember(last_conversation="bbbb")  # it was the last one opened
    with caplog.at_level(logging.WARNING):
        listed = [c.id for c in store.list()]
        restored = tab.restore()
    assert listed == ["aaaa"] and restored[tab.conv_id] == "aaaa"
    lines = [r.getMessage() for r in caplog.records if "bbbb.json" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    with pytest.raises(StoreError):
        store.get("bbbb")
    assert store.load_settings().last_conversation == "aaaa"


def test_links_in_the_conversations_folder_are_not_followed(tab, tmp_path, caplog):
    store = tab.service.store
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(GOOD))
    store.conv_dir.mkdir(parents=True)
    (store.conv_dir / "aaaa.json").symlink_to(elsewhere)
    (store.conv_dir / "bbbb.json").symlink_to("/etc/passwd")
    with caplog.at_level(logging.WARNING):
        assert store.list() == []
    assert sum("symbolic link" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(StoreError, match="symbolic link"):
        store.get("aaaa")


def test_a_fifo_in_the_conversations_folder_never_blocks(tab):
    store = tab.service.store
    store.conv_dir.mkdir(parents=True)
    os.mkfifo(store.conv_dir / "aaaa.json")
    _write(store, "bbbb", json.dumps(GOOD))
    listed = []
    reader = threading.Thread(target=lambda: listed.extend(c.id for c in store.list()),
                              daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():  # release the blocked reader before failing
        with open(store.conv_dir / "aaaa.json", "w") as fifo:
            fifo.write("{}")
        pytest.fail("listing the conversations blocked on a FIFO")
    assert listed == ["bbbb"]


def test_system_prompts_are_capped_and_empty_chats_bounded(tab):
    store = tab.service.store
    with pytest.raises(StoreError, match="longer than"):
        store.new(system="s" * (SYSTEM_CHARS + 1))
    with pytest.raises(SettingError, match="longer than"):
        store.remember(system="s" * (SYSTEM_CHARS + 1))
    for _ in range(3 * EMPTY_KEEP):  # New chat clicked again and again in fresh tabs
        tab.new_conv("", "a long system prompt " * 1000)
    empty = [c for c in store.list() if not c.messages]
    assert len(empty) == EMPTY_KEEP


def test_a_kept_copy_that_does_not_read_is_not_brought_back(tab):
    store = tab.service.store
    conv = store.new()
    store.delete(conv.id)
    (store.trash_dir / f"{conv.id}.json").write_text("[" * 100_000)
    with pytest.raises(StoreError, match="unreadable"):
        store.undo(conv.id)
    assert store.list() == []
