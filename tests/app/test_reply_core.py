"""The one reply path (app/reply_core.py): the datastore's write starts only after a
reply's final update was handed over and never holds up the next reply, and the terminal
chat learns into the app's own datastore."""

from __future__ import annotations

import json
import threading

import pytest

from app.replies import ReplyRequest
from app.service import Service
from app.store import Store
from app.ui import readout
from engine.config import SamplingParams
from engine.datastore import disk, load
from engine.drafters.datastore_source import store_file

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_final_update_goes_out_before_the_datastore_is_written(service, monkeypatch):
    """A slow disk: each write waits until the test lets it go. The reply's final update
    comes first, and the next reply runs to its end while the write still waits."""
    order: list[str] = []
    writing, release = threading.Event(), threading.Event()
    real = disk.persist

    def slow_disk(path, pending):
        order.append("write starts")
        writing.set()
        release.wait(120)  # a bound on a broken test, not a timing
        real(path, pending)
        order.append("write ends")

    monkeypatch.setattr(disk, "persist", slow_disk)
    conv = service.store.new()
    for update in service.replies.chat(ReplyRequest(conv.id, GREEDY), "Tell me about rain"):
        if update.done:
            order.append("final update")
    assert writing.wait(120)
    assert order == ["final update", "write starts"]
    last = list(service.replies.chat(ReplyRequest(conv.id, GREEDY), "And snow?"))[-1]
    order.append("next reply ends")
    release.set()
    service.accels.writer.flush()
    assert last.done and last.stats.stop_reason in ("eos", "length")
    assert order == ["final update", "write starts", "next reply ends", "write ends",
                     "write starts", "write ends"]
    reloaded = load.load(store_file(service.host.lm), service.host.lm.fingerprint)
    assert [d.tolist() for d in reloaded.docs] == [d.tolist() for d in
                                                   service.accels.datastore.docs]


def test_the_terminal_chat_learns_into_the_apps_datastore(tiny, monkeypatch, capsys):
    import app.commands.chat as command
    from app.cli import main

    monkeypatch.setattr(command, "load", lambda args, compiled="load": tiny)
    assert main(["chat", "--prompt", "Tell me about rain", "--max-new-tokens", "12",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["accel"] == "off" and out["stats"]["tokens"] == len(out["token_ids"])
    # the page's service, opened afterwards, drafts from what the terminal's reply said
    docs = Service(Store(), tiny).accels.datastore.docs
    assert [d.tolist() for d in docs] == [out["token_ids"]]


def test_api_replies_are_kept_out_of_the_datastore(service):
    from app.reply_core import Ask
    from engine.decode.chat_template import conversation

    steps = list(service.replies.complete(Ask(conversation("hello"), GREEDY), None))
    service.accels.writer.flush()
    assert steps[-1].done and steps[-1].message["stats"]["tokens"] == steps[-1].stats.tokens
    assert service.accels.datastore.tokens == 0


def test_a_reply_that_waited_for_the_model_is_timed_from_when_its_turn_came(service,
                                                                            monkeypatch):
    """Injects timings: a clock that moves 100 s while the reply waits for the model (another
    reply holds it) and a millisecond per reading after that."""
    import engine.decode.generate

    now = [0.0]

    def clock() -> float:
        now[0] += 0.001
        return now[0]

    monkeypatch.setattr(engine.decode.generate, "time", type("Clock", (), {"perf_counter": clock}))
    conv = service.store.new()
    done = []
    with service.host.lock:  # the model is busy: the reply waits for it
        waiting = threading.Thread(target=lambda: done.extend(
            u for u in service.replies.chat(ReplyRequest(conv.id, GREEDY), "Hello") if u.done))
        waiting.start()
        now[0] += 100.0
    waiting.join(120)
    stats = done[-1].stats
    assert stats.tokens > 0 and stats.elapsed_s < 1.0  # its turn, not its wait
    assert "waiting in the queue is not counted" in readout.TIPS["tps"]
