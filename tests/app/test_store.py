"""Conversation and settings files: round trips, bad files, and crashes in the middle of a save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.conversation import title_from_prompt
from app.store import Settings, Store, StoreError, atomic_write_text
from tests.paths import ROOT


def test_conversation_round_trip_and_order(tmp_path):
    store = Store(tmp_path)
    first = store.new(system="be brief")
    second = store.new()
    first.messages.append({"role": "user", "content": "hi"})
    store.save(first)  # touched last: listed first
    listed = store.list()
    assert [c.id for c in listed] == [first.id, second.id]
    again = Store(tmp_path).get(first.id)  # a fresh store, as on the next launch
    assert again.system == "be brief"
    assert again.turns() == [{"role": "user", "content": "hi"}]


def test_rename_delete_and_bad_ids(tmp_path):
    store = Store(tmp_path)
    conv = store.new()
    assert store.rename(conv.id, "  Trip   plans ").title == "Trip plans"
    with pytest.raises(StoreError, match="needs a name"):
        store.rename(conv.id, "   ")
    with pytest.raises(StoreError, match="not a conversation id"):
        store.get("../settings")
    store.delete(conv.id)
    assert store.list() == []
    with pytest.raises(StoreError, match="no conversation"):
        store.get(conv.id)


def test_export_markdown_and_json(tmp_path):
    store = Store(tmp_path)
    conv = store.new(system="sys")
    conv.title = "Rain / poems?"
    conv.messages += [{"role": "user", "content": "a poem"},
                      {"role": "assistant", "content": "rain falls", "stats": {"tokens": 2}}]
    store.save(conv)
    md = store.export(conv.id, "md")
    assert md.name.endswith(".md") and "/" not in md.name
    text = md.read_text()
    assert "# Rain / poems?" in text and "**You**" in text and "rain falls" in text
    data = json.loads(store.export(conv.id, "json").read_text())
    assert data["messages"][1]["stats"] == {"tokens": 2}
    with pytest.raises(StoreError, match="format"):
        store.export(conv.id, "pdf")


def test_unreadable_files_are_skipped_not_fatal(tmp_path):
    store = Store(tmp_path)
    good = store.new()
    (store.conv_dir / "0badbad.json").write_text("{not json")
    (store.conv_dir / "0badbae.json").write_text(json.dumps({"id": "0badbae"}))  # fields missing
    assert [c.id for c in store.list()] == [good.id]
    with pytest.raises(StoreError, match="unreadable"):
        store.get("0badbad")


def test_settings_defaults_round_trip_and_bad_values(tmp_path):
    store = Store(tmp_path)
    assert store.load_settings() == Settings()
    store.save_settings(Settings(model="org/model", temperature=0.7, accel="medusa"))
    assert store.load_settings().model == "org/model"
    store.settings_path.write_text(json.dumps({"temperature": 1, "top_k": "lots",
                                               "trust_remote_code": "yes", "extra": 1}))
    loaded = store.load_settings()
    assert loaded.temperature == 1.0  # an int where a float is expected is fine
    assert loaded.top_k == Settings().top_k  # wrong types fall back to the defaults
    assert not hasattr(loaded, "trust_remote_code")  # only the command line allows code
    store.settings_path.write_text("[1, 2")
    assert store.load_settings() == Settings()


def test_titles_from_prompts():
    assert title_from_prompt("  Hello\n  there ") == "Hello there"
    long = title_from_prompt("word " * 30)
    assert long.endswith("…") and len(long) <= 49


def test_failed_write_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "f.json"
    atomic_write_text(target, "old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]


# A child process that dies (os._exit: no cleanup, no exception handlers) halfway through
# writing the file: what a power cut or a killed app does.
CRASH_CHILD = textwrap.dedent("""
    import builtins, os, sys
    from app.store import Store

    real_open = builtins.open

    class Dying:
        def __init__(self, f):
            self.f = f
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.f.close()
        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            os._exit(9)
        def __getattr__(self, name):
            return getattr(self.f, name)

    def dying_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return Dying(f) if "w" in mode else f

    store = Store(sys.argv[1])
    conv = store.get(sys.argv[2])
    conv.messages.append({"role": "assistant", "content": "x" * 100000})
    builtins.open = dying_open
    if sys.argv[3] == "store":
        store.save(conv)
    else:  # the naive way: write the file in place
        with open(store.conv_dir / (conv.id + ".json"), "w") as f:
            f.write("{" + "x" * 100000 + "}")
""")


def _crash_while_saving(tmp_path: Path, how: str) -> tuple[Store, str]:
    store = Store(tmp_path)
    conv = store.new()
    conv.messages.append({"role": "user", "content": "keep me"})
    store.save(conv)
    proc = subprocess.run([sys.executable, "-c", CRASH_CHILD, str(tmp_path), conv.id, how],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr  # it really died mid-write
    return store, conv.id


def test_store_survives_a_crash_during_a_write(tmp_path):
    store, conv_id = _crash_while_saving(tmp_path, "store")
    assert store.get(conv_id).turns() == [{"role": "user", "content": "keep me"}]
    assert [c.id for c in store.list()] == [conv_id]  # the half-written temp file is ignored


def test_writing_in_place_would_lose_the_conversation(tmp_path):
    """Control for the test above: the same crash corrupts a file written in place."""
    store, conv_id = _crash_while_saving(tmp_path, "naive")
    with pytest.raises(StoreError, match="unreadable"):
        store.get(conv_id)


def test_delete_and_clear_can_be_undone(tmp_path):
    store = Store(tmp_path)
    conv = store.new()
    conv.messages.append({"role": "user", "content": "keep me"})
    store.save(conv)
    store.clear(conv.id)
    assert store.get(conv.id).messages == []  # forgotten: the next reply will not see it
    assert store.undo(conv.id).messages[0]["content"] == "keep me"
    store.delete(conv.id)
    assert store.list() == []
    assert store.undo(conv.id).turns() == [{"role": "user", "content": "keep me"}]
    with pytest.raises(StoreError, match="nothing to undo"):
        store.undo(conv.id)


def test_the_trash_keeps_only_the_newest_deletions(tmp_path, monkeypatch):
    monkeypatch.setattr("app.store.TRASH_KEEP", 2)
    store = Store(tmp_path)
    ids = []
    for n in range(3):
        conv = store.new()
        ids.append(conv.id)
        os.utime(store.conv_dir / f"{conv.id}.json", (n, n))  # deleted in this order
        store.delete(conv.id)
    kept = sorted(p.stem for p in store.trash_dir.iterdir())
    assert len(kept) == 2 and ids[0] not in kept


def test_the_same_question_gets_titles_that_tell_the_chats_apart(tmp_path):
    store = Store(tmp_path)
    titles = []
    for _ in range(3):
        conv = store.new()
        conv.title = store.title_for(conv, "What is the capital of France?")
        store.save(conv)
        titles.append(conv.title)
    assert titles == ["What is the capital of France?", "What is the capital of France? (2)",
                      "What is the capital of France? (3)"]


def test_search_finds_every_word_in_titles_and_messages(tmp_path):
    store = Store(tmp_path)
    rain = store.new()
    rain.title = "Weather"
    rain.messages += [{"role": "user", "content": "Why does RAIN fall?"},
                      {"role": "assistant", "content": "Gravity pulls the drops down."}]
    store.save(rain)
    store.new()
    assert [c.id for c in store.list("rain gravity")] == [rain.id]
    assert [c.id for c in store.list("weather")] == [rain.id]
    assert store.list("snow") == [] and len(store.list("")) == 2


def test_text_that_is_not_valid_unicode_is_refused_where_it_enters(tmp_path):
    store = Store(tmp_path)
    conv = store.new()
    for call in (lambda: store.new(system="hi \ud800"), lambda: store.rename(conv.id, "\udfff"),
                 lambda: store.set_system(conv.id, "a\ud800b")):
        with pytest.raises(StoreError, match="not valid text"):
            call()
    assert store.get(conv.id).system == "" and len(store.list()) == 1


def test_a_fifo_named_like_a_conversation_is_skipped_not_waited_on(tmp_path):
    import threading

    store = Store(tmp_path)
    good = store.new()
    os.mkfifo(store.conv_dir / "0abc.json")  # opening it for reading would wait for a writer
    listed = []
    reader = threading.Thread(target=lambda: listed.append(store.list()), daemon=True)
    reader.start()
    reader.join(30)  # a guard against a hang, not a timing
    assert listed and [c.id for c in listed[0]] == [good.id]
    with pytest.raises(StoreError, match="not a regular file"):
        store.get("0abc")
