"""The page tells the truth, checked in Chromium on a page served in this process over a tiny
int4 model (its layers are the packed low-bit kind): Clear forgets, settings survive a reload
without a message sent, the Models tab's figures are the loaded modules', the readout names
the source that made most steps, a training run's bar never goes back and its loss chart has
a numeric axis, a narrow window shows the message box first, a message sent during a reply
is queued, Delete can be undone, and a slow acceleration check never overrides the user."""

from __future__ import annotations

import json
import queue
import re
import threading

import pytest

from app.jobs import Job
from app.sources import label, mix_of
from app.ui.train_tab import MIN_MINUTES
from engine.errors import QuickdraftError
from engine.progress import Progress
from engine.weights import quant
from tests.page_server import BOTS, REPLY_MS, open_conv_id, open_page, send

pytestmark = pytest.mark.browser


def _saved(service, **values) -> bool:
    saved = json.loads(service.store.settings_path.read_text())
    return all(saved.get(k) == v for k, v in values.items())


def test_clear_forgets_the_conversation_and_can_be_undone(site, page, monkeypatch):
    service = site[0]
    seen = []  # what each reply was asked with: its prompt and the earlier turns
    real = service.replies.chat
    monkeypatch.setattr(service.replies, "chat", lambda ask, message: seen.append(
        [m["content"] for m in service.store.get(ask.conv_id).messages] + [message])
        or real(ask, message))
    send(page, "The secret word is banana.", 1)
    page.click("#qd-chatbot button[aria-label=Clear]")
    page.wait_for_selector("#qd-undo-row:has-text('Cleared')")
    assert page.evaluate(BOTS) == 0
    conv_id = open_conv_id(service)
    assert service.store.get(conv_id).messages == []  # forgotten on disk, not only on screen
    page.click("#qd-undo")
    page.wait_for_function(f"() => ({BOTS})() == 1")
    assert "banana" in json.dumps(service.store.get(conv_id).messages)
    page.click("#qd-chatbot button[aria-label=Clear]")
    page.wait_for_selector("#qd-undo-row:has-text('Cleared')")
    send(page, "What was the secret word?", 1)
    assert seen[-1] == ["What was the secret word?"]  # the model saw nothing from before
    assert [m["role"] for m in service.store.get(conv_id).messages] == ["user", "assistant"]


def test_settings_and_typical_survive_a_reload_without_sending(site, page):
    service = site[0]
    for elem_id, value in (("qd-temperature", 0.7), ("qd-top-k", 40), ("qd-max-new", 33)):
        box = page.locator(f"#{elem_id} input[type=number]")
        box.fill(str(value))
        box.press("Enter")
    page.locator("#qd-system textarea").press_sequentially("Answer in French.")
    page.click("#qd-acceptance label:has(input[value=typical])")
    polls = 0  # each setting is written by its own event: wait for the last ones
    while polls < 300 and not _saved(service, acceptance="typical", system="Answer in French."):
        page.wait_for_timeout(100)
        polls += 1
    page.reload()
    page.wait_for_selector("#qd-conversations input:checked")
    assert page.input_value("#qd-temperature input[type=number]") == "0.7"
    assert page.input_value("#qd-top-k input[type=number]") == "40"
    assert page.input_value("#qd-max-new input[type=number]") == "33"
    assert page.input_value("#qd-system textarea") == "Answer in French."
    assert page.locator("#qd-acceptance input[value=typical]").is_checked()
    assert not any(m for c in service.store.list() for m in c.messages if m.get("content")
                   and "French" in str(m["content"]))  # nothing was sent
    service.store.remember(temperature=0.0, top_k=0, max_new_tokens=16, acceptance="auto",
                           system="")


def test_the_models_tab_shows_the_loaded_modules_parameters_and_bytes(site, page, tiny_int4):
    lm, params_before = tiny_int4
    storages = {}
    tensors = [*lm.model.state_dict(keep_vars=True).values(),
               *(m.wide for m in quant.low_bit_layers(lm.model) if m.wide is not None)]
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    page.click("button[role=tab]:has-text('Models')")
    shown = page.inner_text("#qd-model-current")
    assert f"{params_before / 1e6:,.1f} M parameters" in shown  # the logical weights
    assert f"{sum(storages.values()) / 2**20:,.1f} MB in memory" in shown  # what is held
    assert "4-bit weights (int4) on cpu" in shown and "as asked" in shown


def test_the_readout_names_the_source_that_made_most_steps(site, page):
    service = site[0]
    send(page, "one two three one two three one two three one two three one two", 1)
    reply = service.store.get(open_conv_id(service)).messages[-1]
    mix = mix_of(reply["accel"], reply["stats"])
    assert mix.total_steps == reply["stats"]["steps"]
    top = page.inner_text("#qd-readout .qd-sources b")
    assert top.startswith(label(mix.top) + " ")
    assert page.inner_text("#qd-readout .qd-method") == "Auto"  # not the arm it had ready
    shares = [int(x) for x in re.findall(r"(\d+)%", page.inner_text("#qd-readout .qd-sources"))]
    assert abs(sum(shares) - 100) <= len(shares)  # every step counted once (rounding aside)


class FakeRun:
    """A training run whose reports the test hands over one by one."""

    def __init__(self):
        self.reports: queue.Queue = queue.Queue()
        self.job = Job("train", "Medusa for tiny", "medusa")

    def start(self, options, learn_from_chats=True):
        def work():
            while (report := self.reports.get()) is not None:
                if isinstance(report, Exception):
                    raise report  # the run fails with it
                self.job.report(report)
        return self.job.start(work)


# What a run reports, stage by stage: each stage counts its own units from 0, and the ETA
# of the whole run moves (training replaces the budget's estimate with its own).
STAGES = [("data", 1, 4, 40.0, {}), ("data", 4, 4, 30.0, {}), ("features", 1, 10, 28.0, {}),
          ("features", 10, 10, 25.0, {}), ("train", 5, 100, 24.0, {"loss": 9.5}),
          ("train", 50, 100, 40.0, {"loss": 4.25, "head 1 top-1": 0.2}),
          ("train", 100, 100, 5.0, {"loss": 11.0, "head 1 top-1": 0.35}),
          ("calibrate", 1, 4, 3.0, {}), ("done", 1, 1, 0.0, {})]


def test_training_progress_never_goes_back_and_its_charts_are_numeric(site, page, monkeypatch):
    service = site[0]
    run = FakeRun()
    monkeypatch.setattr(service.training, "start", lambda options, learn_from_chats:
                        setattr(service.host, "training", run.job) or run.start(options))
    page.click("button[role=tab]:has-text('Train')")
    assert page.locator("#qd-train-loss").is_visible()  # laid out before a run, empty
    page.click("#qd-train-start")
    widths = []
    for n, (stage, done, total, eta, metrics) in enumerate(STAGES):
        message = f"report {n}"
        run.reports.put(Progress(stage, done, total, message, eta, metrics))
        page.wait_for_selector(f".qd-job-msg:text-is('{message}')")
        style = page.get_attribute(".qd-progress div", "style")
        widths.append(float(re.search(r"width:\s*([\d.]+)%", style).group(1)))
        if n == 0:  # the charts are there from the start, saying when they fill in
            page.wait_for_selector("#qd-train-status :text('fill in once training starts')")
            assert page.locator("#qd-train-accuracy").is_visible()
        if n == 6:  # both charts drawn: loss and held-out accuracy
            page.wait_for_function(f"() => ({Y_AXES})().length == 2")
            axes = page.evaluate(Y_AXES)
            lines = page.locator("#qd-train-loss svg g.mark-line path").count()
            # drawn with room: a chart laid out while hidden draws its lines in 0 px
            heights = page.evaluate(PLOT_HEIGHTS)
    run.reports.put(None)
    assert widths == sorted(widths) and widths[-1] == 100.0
    assert all("linear scale" in a for a in axes), axes  # numbers, not a list of labels
    assert "titled 'loss'" in axes[0] and "titled 'share right'" in axes[1], axes
    assert lines >= 1 and min(heights) > 40, heights


def test_charts_drawn_while_their_tab_was_hidden_have_room_when_it_is_shown(site, page,
                                                                          monkeypatch):
    service = site[0]
    run = FakeRun()
    monkeypatch.setattr(service.training, "start", lambda options, learn_from_chats:
                        setattr(service.host, "training", run.job) or run.start(options))
    page.click("button[role=tab]:has-text('Train')")
    page.click("#qd-train-start")
    page.click("button[role=tab]:has-text('Chat')")  # the run goes on while the user chats
    for stage, done, total, eta, metrics in STAGES[4:7]:
        run.reports.put(Progress(stage, done, total, "training", eta, metrics))
    page.wait_for_function(  # ticks draw the charts in the hidden tab
        "() => document.querySelectorAll('#qd-train-accuracy svg g.mark-line path').length")
    page.click("button[role=tab]:has-text('Train')")
    page.wait_for_function(f"() => ({Y_AXES})().length == 2")
    page.wait_for_function(f"() => Math.min(...({PLOT_HEIGHTS})()) > 40", timeout=10_000)
    run.reports.put(None)


def test_a_failed_run_looks_failed_and_speaks_of_the_pages_controls(site, page, monkeypatch):
    service = site[0]
    run = FakeRun()
    monkeypatch.setattr(service.training, "start", lambda options, learn_from_chats:
                        setattr(service.host, "training", run.job) or run.start(options))
    page.click("button[role=tab]:has-text('Train')")
    assert page.get_attribute("#qd-train-minutes input[type=range]", "min") == str(MIN_MINUTES)
    page.click("#qd-train-start")
    run.reports.put(Progress("data", 2, 3, "13 conversations", 20.0))
    page.wait_for_selector(".qd-job-msg:text-is('13 conversations')")
    running = page.evaluate(BAR_COLOUR)
    run.reports.put(QuickdraftError("too little training data (13 conversations, 0 held out): "
                                    "give training more time with --max-minutes"))
    page.wait_for_selector("#qd-train-status .qd-failed")
    shown = page.inner_text("#qd-train-status")
    assert "give training more time with the Time budget slider" in shown
    assert "--" not in shown and "continues from them" in shown
    assert page.evaluate(BAR_COLOUR) not in (running, "")  # no longer the running colour


# Gradio's "processing" overlays that can be seen (a hidden one stays, at opacity 0)
OVERLAYS = """() => Array.from(document.querySelectorAll('.progress-text')).filter(t =>
    t.innerText.includes('processing') &&
    parseFloat(getComputedStyle(t.closest('.wrap') || t).opacity) > 0.05)
    .map(t => (t.closest('[id]') || {}).id)"""
PLOT_HEIGHTS = """() => ['#qd-train-loss', '#qd-train-accuracy'].map(id =>
    document.querySelector(id + ' svg g.role-scope, ' + id + ' svg g.plot_pathgroup')
    .getBoundingClientRect().height)"""
BAR_COLOUR = "() => getComputedStyle(document.querySelector('.qd-progress div')).backgroundColor"
Y_AXES = """() => Array.from(document.querySelectorAll(
    '#qd-train-loss svg g[aria-label^="Y-axis"], #qd-train-accuracy svg g[aria-label^="Y-axis"]'))
    .map(e => e.getAttribute('aria-label'))"""


def test_a_narrow_window_shows_the_message_box_on_its_first_screen(site):
    _service, url, chrome = site
    narrow = open_page(chrome, url, width=400, height=800)
    try:
        box = narrow.locator("#qd-msg textarea").bounding_box()
        assert box["y"] + box["height"] <= 800 and box["width"] >= 200
        for button in ("#qd-send", "#qd-stop"):  # beside the box, not under it
            b = narrow.locator(button).bounding_box()
            assert b["y"] < box["y"] + box["height"] and box["y"] < b["y"] + b["height"], b
    finally:
        narrow.close()


def test_a_message_sent_during_a_reply_is_queued_and_the_box_emptied(site, page):
    service = site[0]
    service.host.lock.acquire()  # the model is busy (another reply, a model load)
    try:
        page.fill("#qd-msg textarea", "First question")
        page.press("#qd-msg textarea", "Enter")
        page.wait_for_selector("#qd-queued:has-text('Queued')")
        assert page.input_value("#qd-msg textarea") == ""
        page.fill("#qd-msg textarea", "Second question")
        page.press("#qd-msg textarea", "Enter")
        page.wait_for_function("() => document.querySelector('#qd-msg textarea').value == ''")
    finally:
        service.host.lock.release()
    page.wait_for_function(f"() => ({BOTS})() == 2", timeout=REPLY_MS)
    page.wait_for_selector("#qd-readout .qd-done", timeout=REPLY_MS)  # saved when it ends
    users = [m["content"] for m in service.store.get(open_conv_id(service)).messages
             if m["role"] == "user"]
    assert users == ["First question", "Second question"]


def test_delete_can_be_undone_and_the_export_names_its_file(site, page):
    service = site[0]
    send(page, "Remember this chat", 1)
    conv_id = open_conv_id(service)
    page.click("text=Rename · delete · export")
    page.click("button:text-is('JSON')")
    assert re.search(r"Download .+-" + conv_id + r"\.json", page.inner_text("#qd-export-file"))
    page.click("#qd-delete")
    page.wait_for_selector("#qd-undo-row:has-text('Deleted')")
    assert all(c.id != conv_id for c in service.store.list())
    page.click("#qd-undo")
    page.wait_for_selector(f"#qd-conversations input[value='{conv_id}']:checked")
    assert service.store.get(conv_id).messages[0]["content"] == "Remember this chat"


def test_a_slow_acceleration_check_never_overrides_the_users_choices(site):
    service, url, chrome = site
    gate, real = threading.Event(), service.accels.status
    calls = []

    def slow(method):  # the page's own check, as after a model load rebuilds every drafter
        calls.append(method)
        if len(calls) == 1:
            gate.wait(60)
        return real(method)

    earlier = service.store.new()  # the conversation a late restore would jump back to
    earlier.messages.append({"role": "user", "content": "an earlier chat"})
    service.store.save(earlier)
    service.store.remember(last_conversation=earlier.id, accel="auto")
    service.accels.status = slow
    try:
        page = open_page(chrome, url)  # the view is restored while the check waits
        # (a loaded machine may show the page's first selection before the restored one)
        page.wait_for_selector(f"#qd-conversations input[value='{earlier.id}']:checked")
        polls = 0
        while not calls and polls < 600:  # the page's check has reached the server
            page.wait_for_timeout(50)
            polls += 1
        assert page.evaluate(OVERLAYS) == []  # no "processing" over the page
        assert "Checking the accelerators" in page.inner_text("#qd-accel-status")
        page.click("#qd-new")
        page.wait_for_selector("#qd-conversations label:has-text('New chat') input:checked")
        chosen = open_conv_id(service)
        page.click("#qd-accel label:has(input[value=lookup])")
        gate.set()
        page.wait_for_selector("#qd-accel-status:has-text('Lookup is ready')")
        assert page.locator("#qd-accel input[value=lookup]").is_checked()
        assert "Acceleration: Lookup" in page.inner_text("#qd-chat-header")
        assert page.locator(f"#qd-conversations input[value='{chosen}']").is_checked()
        page.close()
    finally:
        gate.set()
        service.accels.status = real
        service.store.remember(accel="auto")
