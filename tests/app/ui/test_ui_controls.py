"""The page's controls keep what they are given, checked in Chromium: a search cleared key by
key shows every conversation again, number boxes typed quickly are saved once each with
their last value, and a message sent while a reply streams stays on screen as queued."""

from __future__ import annotations

import json
import threading

import pytest

from tests.page_server import BOTS, REPLY_MS, open_conv_id, send

pytestmark = pytest.mark.browser
KEY_MS = 20  # a quick typist


def test_a_search_cleared_key_by_key_lists_every_conversation_again(site, page):
    service = site[0]
    send(page, "Tell me about apples", 1)
    page.click("#qd-new")
    send(page, "Tell me about pears", 1)
    labels = page.locator("#qd-conversations label")
    everything = labels.count()
    assert everything >= 2
    search = page.locator("#qd-search textarea")
    search.press_sequentially("zzqq", delay=KEY_MS)
    page.wait_for_function("() => !document.querySelector('#qd-conversations label')")
    for _ in "zzqq":
        search.press("Backspace")
    page.wait_for_function(f"() => document.querySelectorAll('#qd-conversations label')"
                           f".length == {everything}")
    assert page.locator(f"#qd-conversations input[value='{open_conv_id(service)}']").is_checked()


TYPED = (("qd-max-new", "40", "max_new_tokens", 40), ("qd-top-k", "40", "top_k", 40),
         ("qd-temperature", "0.7", "temperature", 0.7), ("qd-top-p", "0.8", "top_p", 0.8))


def test_numbers_typed_quickly_are_saved_once_each_with_their_last_value(site, page,
                                                                          monkeypatch):
    service = site[0]
    saves = []  # every write of the settings file, as the keys and values it changed
    real = service.store.remember
    monkeypatch.setattr(service.store, "remember", lambda **kw: saves.append(kw) or real(**kw))
    # typing pauses decide when a change is over; a slow machine must not split one
    monkeypatch.setattr(service.page_settings, "quiet_s", 3.0)
    for elem_id, text, _key, _value in TYPED:
        box = page.locator(f"#{elem_id} input[type=number]")
        box.click()
        box.press("Control+a")
        box.press_sequentially(text, delay=KEY_MS)
    polls = 0  # the page has sent what was typed (the file is written once typing pauses)
    while service.page_settings.pending != {k: v for *_x, k, v in TYPED} and polls < 300:
        page.wait_for_timeout(50)
        polls += 1
    page.reload()  # a reload right after typing: what was typed is saved first
    page.wait_for_selector("#qd-conversations input:checked")
    for elem_id, text, key, value in TYPED:
        assert page.input_value(f"#{elem_id} input[type=number]") == text
        assert [s[key] for s in saves if key in s] == [value], (key, saves)
    saved = json.loads(service.store.settings_path.read_text())
    assert [saved[key] for *_x, key, _v in TYPED] == [value for *_x, value in TYPED]
    service.store.remember(temperature=0.0, top_k=0, max_new_tokens=16, top_p=0.9)


def test_a_message_sent_while_a_reply_streams_shows_as_queued_until_it_starts(site, page,
                                                                              monkeypatch):
    service = site[0]
    go = threading.Event()  # the first reply streams slowly until the test lets it finish
    real = service.replies.core.stream

    def slow(ask, cancel=None):
        for n, step in enumerate(real(ask, cancel)):
            if n > 2:
                go.wait(0.15)
            yield step

    monkeypatch.setattr(service.replies.core, "stream", slow)
    service.store.remember(max_new_tokens=60)
    try:
        page.reload()
        page.wait_for_selector("#qd-conversations input:checked")
        page.fill("#qd-msg textarea", "First question")
        page.click("#qd-send")
        page.wait_for_selector("#qd-readout .qd-live:has-text('tokens…')", timeout=REPLY_MS)
        page.fill("#qd-msg textarea", "Second question")
        page.press("#qd-msg textarea", "Enter")
        note = page.wait_for_selector("#qd-queued:has-text('Second question')")
        assert "Queued" in note.inner_text() and page.input_value("#qd-msg textarea") == ""
        shown = _tokens_shown(page)
        page.wait_for_function(f"() => parseInt(document.querySelector('#qd-readout "
                               f".qd-live')?.innerText) > {shown + 4}", timeout=REPLY_MS)
        assert "Second question" in page.inner_text("#qd-queued")  # still there, streaming on
        go.set()
        page.wait_for_function(f"() => ({BOTS})() == 2", timeout=REPLY_MS)
        page.wait_for_function("() => !document.querySelector('#qd-queued')"
                               ".innerText.includes('Second question')")
        page.wait_for_selector("#qd-readout .qd-done", timeout=REPLY_MS)
    finally:
        go.set()
        service.store.remember(max_new_tokens=16)
    users = [m["content"] for m in service.store.get(open_conv_id(service)).messages
             if m["role"] == "user"]
    assert users == ["First question", "Second question"]


def _tokens_shown(page) -> int:
    return int(page.inner_text("#qd-readout .qd-live").split()[0])


FOCUSED = """() => { const e = document.activeElement; if (!e) return '';
    return `${(e.closest('[id^=qd-]') || {}).id || ''}|${e.type || ''}|${e.value || ''}`; }"""


def _tab_until(page, wanted: str, presses: int = 60) -> list[str]:
    """Press Tab until the focus is inside #`wanted`: the focused places on the way."""
    seen = []
    for _ in range(presses):
        page.keyboard.press("Tab")
        seen.append(page.evaluate(FOCUSED))
        if seen[-1].startswith(wanted + "|"):
            return seen
    raise AssertionError(f"Tab never reached #{wanted}: {seen}")


def test_the_keyboard_walks_the_page_in_order_one_stop_per_radio_group(site, page):
    page.reload()
    page.wait_for_selector("#qd-conversations input:checked")
    seen = _tab_until(page, "qd-msg")  # from the top of the page
    assert any(s.startswith("qd-conversations|radio") for s in seen), seen  # the list first
    page.focus("#qd-accel input[value=auto]")
    page.keyboard.press("Tab")  # one stop for the whole group: the focus leaves it
    assert not page.evaluate(FOCUSED).startswith("qd-accel|"), page.evaluate(FOCUSED)
    try:
        page.focus("#qd-accel input[value=auto]")
        page.keyboard.press("ArrowDown")  # the arrows move the choice, and the page hears it
        page.wait_for_selector("#qd-accel-status:has-text('Plain decoding')")
        assert page.locator("#qd-accel input[value=off]").is_checked()
        page.keyboard.press("ArrowUp")
        page.wait_for_function("() => document.querySelector('#qd-accel-status').innerText"
                               ".startsWith('Auto')")
        assert page.locator("#qd-accel input[value=auto]").is_checked()
    finally:
        site[0].store.remember(accel="auto")  # what the next tests' pages start with


def test_the_focused_conversation_shows_a_plain_ring(site, page):
    page.reload()
    page.wait_for_selector("#qd-conversations input:checked")
    _tab_until(page, "qd-conversations")
    style = page.evaluate("""() => { const l = document.activeElement.closest('label');
        const s = getComputedStyle(l); return [s.outlineStyle, parseFloat(s.outlineWidth)]; }""")
    assert style[0] != "none" and style[1] >= 2, style
