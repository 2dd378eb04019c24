"""The first start says what it is doing: the page is served while the model loads behind it,
its header and the terminal show each stage as it goes (converting, choosing the weights
with its budget, building kernels, compiling steps), and a message sent meanwhile waits for
the model instead of failing."""

from __future__ import annotations

import threading

import gradio as gr

from app.service import Service
from app.store import Store
from app.ui.chat_tab import ChatTab
from app.ui.layout import build_app
from engine.config import ModelSpec
from engine.progress import Progress
from tests.conftest import make_tiny_model


def slow_load(tiny, go: threading.Event):
    """A load_model that reports a stage, then waits for `go`."""
    def load(spec, report=None):
        report("choosing weights by their answers and speed (first time only: 3 s of at "
               "most ~60 s)")
        go.wait(60)
        return tiny
    return load


def test_the_page_is_served_while_the_model_loads(tmp_path, bundled_tokenizer, monkeypatch):
    tiny = make_tiny_model("llama-mha", bundled_tokenizer)
    go, heard = threading.Event(), []
    monkeypatch.setattr("app.host.load_model", slow_load(tiny, go))
    service = Service.open(Store(tmp_path), ModelSpec("default", "auto"), background=True,
                           echo=heard.append)
    with gr.Blocks():
        tab = ChatTab(service)
    try:
        assert service.host.current is None and service.host.loading.running
        header = tab.header_text("auto")
        assert header.startswith("**Loading default…**")
        assert "choosing weights by their answers and speed" in header
        assert "at most ~60 s" in service.host.activity()
        ticked = tab.show_activity("auto", False)
        assert ticked[tab.model_ready] is False and tab.activity not in ticked  # ticks on
        # a message sent meanwhile waits for the model, then is answered
        replies = []
        sender = threading.Thread(target=lambda: replies.extend(
            tab.send("Tell me about rain", "", "", 0.0, 1.0, 0, 4, "auto", "off", None)))
        sender.start()
        sender.join(0.5)
        assert sender.is_alive() and not replies  # waiting, not refused
    finally:
        go.set()
    sender.join(120)
    assert replies and "qd-error" not in replies[-1][tab.readout]
    assert service.host.lm is tiny and service.host.activity() == ""
    ticked = tab.show_activity("auto", False)
    assert ticked[tab.model_ready] is True and tab.activity in ticked  # the timer stops
    assert "**tiny-llama-mha**" in ticked[tab.header] and "⏳" not in ticked[tab.header]
    assert [p.message for p in heard if p.stage == "load"][-1].startswith("choosing weights")
    assert heard[-1].stage == "done"


def test_the_compiled_steps_build_shows_in_the_header_and_the_terminal(tmp_path, tiny):
    heard = []
    service = Service(Store(tmp_path), tiny)
    service.host.echo = heard.append
    with gr.Blocks():
        tab = ChatTab(service)
    tiny.target.steps.compiling = True  # a builder process is at work
    service.host._compiling(tiny, Progress("compile", 2, 5, "compiling the decode step: 2 of 5 "
                                                            "parts", eta_s=31))
    header = tab.header_text("off")
    assert "compiling the decode step: 2 of 5 parts, about 31 s left" in header
    assert "replies meanwhile on the eager step" in header and heard[-1].done == 2
    tiny.target.steps.compiling = False
    assert "⏳" not in tab.header_text("off")


def test_a_first_kernel_build_is_announced(tmp_path, monkeypatch, bundled_tokenizer):
    from engine.model import loading
    from engine.weights import kernels

    lm = make_tiny_model("llama-gqa", bundled_tokenizer)
    lm.model.save_pretrained(tmp_path / "tiny")
    bundled_tokenizer.save_pretrained(tmp_path / "tiny")
    monkeypatch.setattr(kernels, "needs_building", lambda: True)
    said = []
    loading.load_model(ModelSpec(str(tmp_path / "tiny"), "int8w"), said.append)
    assert said and said[0].startswith("building Quickdraft's CPU kernels for this machine")
    said.clear()
    loading.load_model(ModelSpec(str(tmp_path / "tiny"), "fp32"), said.append)
    assert said == []  # full precision needs no kernels


def test_the_other_tabs_catch_up_once_the_model_loaded_behind_an_open_page(tmp_path, tiny):
    """A page opened while the model loads learns it is there from a state the header's
    timer sets (ChatTab.model_ready); the Models and Train tabs, drawn when the page opened,
    refresh when that state changes."""
    config = build_app(Service(Store(tmp_path), tiny)).get_config_file()
    ids = {c.get("props", {}).get("elem_id"): c["id"] for c in config["components"]}
    states = {c["id"] for c in config["components"] if c.get("type") == "state"}
    deps = config["dependencies"]

    def chain(dep: dict) -> list[dict]:  # an event and the .then() steps after it
        return [dep] + [d for after in deps if after.get("trigger_after") == dep["id"]
                        for d in chain(after)]

    on_state = [d for d in deps if any(t[0] in states and t[1] == "change"
                                       for t in d["targets"])]
    refreshed = [{o for d in chain(dep) for o in d["outputs"]} for dep in on_state]
    wanted = {ids["qd-model-current"], ids["qd-model-status"], ids["qd-train-target"]}
    assert any(wanted <= outputs for outputs in refreshed)
