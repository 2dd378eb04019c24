"""Every event the page registers, called as any client can call it (Gradio's API takes any
JSON for any input): with null, a number, a list, a long string and a lone surrogate in
every field. Each answers, or refuses in one line naming the field; no Python type, message
or path reaches the client. And an event that has nothing to change leaves the page as
it is."""

from __future__ import annotations

import asyncio
import os
import re
from concurrent.futures import ThreadPoolExecutor

import gradio as gr
import pytest
from gradio.state_holder import SessionState

from app.service import Service
from app.store import Store
from app.ui.layout import build_app
from engine.model.loading import resolve_folder


def _run(coro):
    """`asyncio.run` on a thread of its own: a browser test earlier in the same process
    leaves Playwright's event loop running on this one, where asyncio.run refuses."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


HOSTILE = [None, 5, [1, 2], "x" * 200_000, "a\ud800b"]
# What only Python says: exception and type names, its messages, tracebacks, file paths.
PYTHONISMS = re.compile(
    r"<class '|\b(NoneType|TypeError|ValueError|AttributeError|KeyError|IndexError|OSError|"
    r"RuntimeError|RecursionError|UnicodeError|Traceback|pydantic|Errno)\b|object has no "
    r"attribute|not supported between instances|validation error|\.py\b|site-packages|"
    r"codec can't|\bsys\.\w|int_max_str_digits|/tmp/|/home/|/work/|/usr/|[A-Z]:\\\\")


@pytest.fixture
def page(tmp_path, tiny, monkeypatch):
    """The page over a tiny model; a model load resolves its source as the app does (a bad
    name fails there) and then loads the tiny model, never a real one."""
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    monkeypatch.setattr("app.host.load_model",
                        lambda spec, report=None: resolve_folder(spec) and tiny)
    monkeypatch.setattr("app.catalog.fetch_if_needed", lambda spec, report: None)  # no hub
    service = Service(Store(tmp_path / "data"), tiny)
    return build_app(service), service


async def _call(demo, fn, inputs: list, state: SessionState) -> list:
    """Run one event to its end (every step of a generator): the data of each step."""
    out = await demo.process_api(fn, inputs, state, None)
    steps = [out["data"]]
    while out.get("is_generating"):
        out = await demo.process_api(fn, [], state, None, iterator=out["iterator"])
        steps.append(out["data"])
    return steps


def _shown(data) -> list[str]:
    """The texts of an event's outputs that say something went wrong."""
    found = []
    for value in data if isinstance(data, list) else [data]:
        text = value if isinstance(value, str) else str(value)
        if "qd-error" in text or "⚠" in text:
            found.append(text)
    return found


def test_every_event_answers_hostile_values_in_one_line(page, recwarn):
    demo, service = page
    said = {}

    async def each() -> None:
        for fn in demo.fns.values():
            for value in HOSTILE:
                state = SessionState(demo)
                shown = said.setdefault((fn.name, repr(value)[:12]), [])
                try:
                    for data in await _call(demo, fn, [value] * len(fn.inputs), state):
                        shown += _shown(data)
                except gr.Error as exc:
                    shown.append(exc.message)

    _run(each())
    said[("warnings", "")] = [str(w.message) for w in recwarn]  # gr.Warning, outside a page
    assert len({name for name, _ in said}) >= 20  # every tab's events were called
    leaked = {k: v for k, v in said.items() if any(PYTHONISMS.search(t) for t in v)}
    assert not leaked
    long_lines = {k: v for k, v in said.items() if any("\n" in t or len(t) > 600 for t in v)}
    assert not long_lines
    refused = said[("load", repr("a\ud800b")[:12])]
    assert refused == ["Model: holds a character that is not valid text (a lone surrogate)"]
    long_name = " ".join(said[("requantize", repr("x" * 200_000)[:12])])
    assert "is not the name of a model, a folder or a file" in long_name
    assert service.host.lm is not None


def _fn(demo, name: str):
    return next(fn for fn in demo.fns.values() if fn.name == name)


def test_an_event_with_nothing_to_change_leaves_the_page_as_it_is(page):
    """Delete in a tab whose conversation another tab deleted: a warning, nothing else."""
    demo, service = page
    conv = service.store.new()
    service.store.delete(conv.id)
    delete = _fn(demo, "delete")
    state = SessionState(demo)
    state[delete.inputs[0]._id] = conv.id  # this tab's open conversation, gone
    data = _run(_call(demo, delete, [None], state))[-1]
    shown = [d for o, d in zip(delete.outputs, data, strict=True) if not o.stateful]
    assert shown and all(d.get("__type__") == "update" and set(d) <= {"__type__", "props"}
                         for d in shown)  # an update of nothing: every output stays
    assert state[delete.inputs[0]._id] == conv.id


def test_a_field_longer_than_it_takes_is_refused(page):
    demo, service = page
    save = _fn(demo, "save_system")
    with pytest.raises(gr.Error) as refused:
        _run(_call(demo, save, [None, "s" * 100_001], SessionState(demo)))
    assert refused.value.message == "System prompt: is longer than 100,000 characters"
    assert service.store.load_settings().system == ""


FILE = {"_type": "gradio.FileData"}


@pytest.mark.parametrize("upload", ["prompts.txt", {"path": "prompts.txt"},
                                    {"path": "/etc/passwd", "meta": FILE},
                                    {"path": "../../../etc/passwd", "meta": FILE},
                                    {"path": "UPLOADS/../../passwd", "meta": FILE},
                                    [{"path": 5}]])
def test_a_file_field_takes_only_what_the_page_uploaded(page, monkeypatch, upload):
    demo, service = page
    monkeypatch.setattr(service.training, "start", lambda *a, **k: pytest.fail("it started"))
    start = _fn(demo, "start")
    if isinstance(upload, dict):
        upload = {**upload, "path": upload["path"].replace("UPLOADS", os.environ[
            "GRADIO_TEMP_DIR"])}
    with pytest.raises(gr.Error) as refused:
        _run(_call(demo, start, ["medusa", 5, upload, False], SessionState(demo)))
    message = refused.value.message
    assert message.startswith("Extra prompts") and not PYTHONISMS.search(message)
    assert "passwd" not in message and "prompts.txt" not in message
