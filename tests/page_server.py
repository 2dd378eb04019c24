"""The page served in this process over a service the test builds (a tiny model, a fake
training run), driven by Playwright in Debian's Chromium. Faster than launching the app, and
a test can reach into the service while the page runs (gate a slow call, feed a job)."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
REPLY_MS = 120_000  # a reply of the tiny model on a busy 2-core machine
BOTS = "() => document.querySelectorAll('#qd-chatbot [data-testid=bot]').length"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium() -> str:
    """Debian's Chromium, or a skip (a failure on CI) when it is missing."""
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return CHROMIUM


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve(service):
    """The app's page over `service` on a free loopback port: yields its URL."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from app.ui.launch import page_style
    from app.ui.layout import build_app

    demo = build_app(service)
    demo.queue(default_concurrency_limit=1)
    _app, url, _share = demo.launch(server_name="127.0.0.1", server_port=free_port(),
                                    prevent_thread_lock=True, **page_style(), ssr_mode=False,
                                    quiet=True, footer_links=[])
    try:
        yield url
    finally:
        demo.close()


@contextmanager
def browser():
    """A headless Chromium (Playwright's sync API)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chrome = p.chromium.launch(executable_path=chromium(), headless=True, args=CHROMIUM_ARGS)
        try:
            yield chrome
        finally:
            chrome.close()


def open_page(chrome, url: str, width: int = 1400, height: int = 960):
    """A page on `url` once it has restored its state (a conversation is selected)."""
    page = chrome.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(60_000)
    page.goto(url)
    page.wait_for_selector("#qd-msg textarea")
    page.wait_for_selector("#qd-conversations input:checked")
    return page


def send(page, text: str, replies: int) -> None:
    """Send `text` and wait until reply number `replies` has ended."""
    page.fill("#qd-msg textarea", text)
    page.click("#qd-send")
    page.wait_for_function(f"() => ({BOTS})() == {replies}", timeout=REPLY_MS)
    page.wait_for_selector("#qd-readout .qd-done", timeout=REPLY_MS)


def open_conv_id(service) -> str:
    return service.store.load_settings().last_conversation
