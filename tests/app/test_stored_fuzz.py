"""Random damage to every kind of file the app stores: 200 mutations of each (bytes flipped,
inserted or cut; JSON values swapped for nulls, numbers, lists, deep nesting, "\\ud800"
escapes; safetensors headers rewritten; a FIFO, a link or a folder in the file's place),
seeded. After each, the app starts on its data folder, lists and opens its conversations,
and replies; a file it cannot use is skipped or rebuilt, never a failure or a hang."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct

import gradio as gr
import pytest

from app.replies import ReplyRequest
from app.service import Service
from app.store import Store, StoreError
from app.ui.chat_tab import ChatTab
from engine.config import SamplingParams
from engine.datastore.disk import log_path
from engine.drafters.accelerators import INFO, METRICS, WEIGHTS
from engine.drafters.datastore_source import store_file
from engine.errors import QuickdraftError
from engine.prompt_files import read_prompt_file
from tests.engine.drafters.test_accelerators import _save

pytestmark = pytest.mark.usefixtures("one_thread")
MUTATIONS = 200
ONE_TOKEN = SamplingParams(temperature=0.0, max_new_tokens=1)
HOSTILE = [None, 0, -1, 2**70, 1.5, True, "", "\ud800", "x" * 5000, [], [1, "a"], {},
           {"a": [None]}]


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random damage to a file's bytes (a JSON value swapped where the file is JSON
    or a safetensors header)."""
    kind = rng.randrange(7)
    if kind == 0 and data:  # bytes flipped
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] = rng.randrange(256)
        return bytes(out)
    if kind == 1:  # cut short
        return data[:rng.randrange(len(data) + 1)]
    if kind == 2:  # something inserted
        at = rng.randrange(len(data) + 1)
        extra = rng.choice([b"[" * 3000, b'"\\ud800"', b"\xff\xfe", b"\x00", b"NaN", b"}",
                            b"9" * 5000, bytes(rng.randrange(256) for _ in range(16))])
        return data[:at] + extra + data[at:]
    if kind == 3 and len(data) > 2:  # a slice repeated
        a, b = sorted(rng.sample(range(len(data)), 2))
        return data[:b] + data[a:b] + data[b:]
    return _swap_value(data, rng)


def _swap_value(data: bytes, rng: random.Random) -> bytes:
    """A value of the JSON (whole file, or a safetensors header) replaced by a hostile one."""
    header = len(data) >= 8 and not data.lstrip().startswith((b"{", b"["))
    try:
        if header:
            size = struct.unpack("<Q", data[:8])[0]
            value, rest = json.loads(data[8:8 + size]), data[8 + size:]
        else:
            value, rest = json.loads(data), b""
    except (ValueError, struct.error, RecursionError):
        return data[::-1]
    value = _replace_somewhere(value, rng)
    text = json.dumps(value).encode()
    return struct.pack("<Q", len(text)) + text + rest if header else text


def _replace_somewhere(value, rng: random.Random):
    if not isinstance(value, dict | list) or not value or rng.random() < 0.25:
        return rng.choice(HOSTILE)
    key = rng.choice(list(value)) if isinstance(value, dict) else rng.randrange(len(value))
    value[key] = _replace_somewhere(value[key], rng)
    return value


def place(path, data: bytes, rng: random.Random, special: bool) -> None:
    """Write `data` at `path`; or, now and then, something that is not a file."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    choice = rng.randrange(4) if special else None
    if choice == 0:
        os.mkfifo(path)
    elif choice == 1:
        path.symlink_to("/dev/zero")
    elif choice == 2:
        path.mkdir()
    else:
        path.write_bytes(data)


@pytest.fixture
def app(tmp_path, tiny, monkeypatch):
    """The service and the Chat tab on a data folder with one conversation replied to (its
    reply learned into the datastore), a Medusa accelerator and a deleted conversation.
    Writes are not flushed to the disk here: durability is not what this checks."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    service = Service(Store(tmp_path / "data"), tiny)
    with gr.Blocks():
        tab = ChatTab(service)
    service.store.remember(accel="auto", temperature=0.0, system="be brief")
    conv = service.store.new(system="be brief")
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    list(service.replies.chat(ReplyRequest(conv.id, params, "auto"), "one two one two"))
    service.accels.writer.flush()
    gone = service.store.new()
    list(service.replies.chat(ReplyRequest(gone.id, params, "off"), "hello"))
    service.store.delete(gone.id)
    _save(service.host.lm)
    return service, tab, conv.id


def check(service: Service, tab: ChatTab, conv_id: str, method: str | None = "auto") -> None:
    """The app starts on the folder as it is (the page's load: the list, the last
    conversation opened, then the saved acceleration checked, which reads its accelerators
    and datastore); with a `method`, every listed conversation opens and a reply decoded
    with it ends."""
    restored = tab.restore()
    assert restored[tab.conv_id]
    assert tab.check_accel(restored[tab.active])[tab.accel_status]
    if method is None:
        return
    for conv in service.store.list():
        tab.show(service.store.get(conv.id))
    try:
        target = service.store.get(conv_id).id
    except StoreError:
        target = service.store.new().id  # its own file was the one damaged
    last = list(service.replies.chat(ReplyRequest(target, ONE_TOKEN, method), "one word"))[-1]
    assert last.done and last.stats.tokens >= 1


def _run(app, path, methods, seed: int, reopen: bool = False) -> None:
    """MUTATIONS damaged versions of the file at `path`, each checked (every fourth with a
    reply, by each of `methods` in turn); `reopen`: what was read from disk is read again."""
    service, tab, conv_id = app
    original = path.read_bytes()
    rng = random.Random(seed)
    for i in range(MUTATIONS + 1):
        damaged = mutate(original, rng) if i < MUTATIONS else original  # and back at the end
        place(path, damaged, rng, special=i < MUTATIONS and i % 10 == 0)
        if reopen:
            service.accels.forget()
        check(service, tab, conv_id, methods[i // 4 % len(methods)] if i % 4 == 0 else None)


def test_damaged_conversations(app):
    service, tab, conv_id = app
    original = service.store._path(conv_id).read_bytes()
    rng = random.Random(1)
    for i in range(MUTATIONS):  # all of them side by side, as a folder collects them
        place(service.store.conv_dir / f"{i + 1:x}ff.json", mutate(original, rng), rng,
              special=i % 10 == 0)
    check(service, tab, conv_id)
    assert len(service.store.list()) >= 2  # the good one and many damaged but readable


def test_damaged_settings(app):
    _run(app, app[0].store.settings_path, ("auto",), seed=2)


@pytest.mark.parametrize("name", [INFO, METRICS, WEIGHTS])
def test_damaged_accelerators(app, name):
    from engine.drafters.accelerators import checkpoint_dir

    folder = checkpoint_dir(app[0].host.lm.fingerprint, "medusa")
    _run(app, folder / name, ("auto", "medusa", "medusa+datastore"),
         seed=[INFO, METRICS, WEIGHTS].index(name) + 10)


@pytest.mark.parametrize("which", ["snapshot", "log"])
def test_damaged_datastore(app, which):
    service = app[0]
    snapshot = store_file(service.host.lm)
    path = log_path(snapshot) if which == "log" else snapshot
    assert path.is_file()  # the fixture's reply was learned: its record is in the log
    _run(app, path, ("auto", "datastore"), seed=20 + (which == "log"), reopen=True)


def test_damaged_trash(app):
    service, tab, conv_id = app
    kept = next(service.store.trash_dir.glob("*.json"))
    original, rng = kept.read_bytes(), random.Random(3)
    for i in range(MUTATIONS):
        place(kept, mutate(original, rng), rng, special=i % 10 == 0)
        try:
            service.store.undo(kept.stem)
            service.store.delete(kept.stem)  # back to the trash for the next mutation
        except StoreError:
            pass
        check(service, tab, conv_id, "off" if i % 4 == 0 else None)


def test_damaged_prompt_files(tmp_path):
    """An uploaded prompts file: read, or refused in one line."""
    original = b'{"prompt": "hi", "category": "chat"}\n{"turns": ["a", "b"]}\n'
    path, rng = tmp_path / "prompts.jsonl", random.Random(4)
    for i in range(MUTATIONS):
        place(path, mutate(original, rng), rng, special=i % 10 == 0)
        try:
            assert read_prompt_file(path, "user")
        except QuickdraftError as exc:
            assert "\n" not in str(exc)
