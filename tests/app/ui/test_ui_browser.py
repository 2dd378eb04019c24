"""The app as a person uses it: `python launcher.py` on a free loopback port with the bundled
model, driven by Playwright in Debian's Chromium. Plus the launch rules (no browser needed).

Set QUICKDRAFT_SCREENSHOT=path to save a screenshot of the chat with its readout.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from unittest import mock

import pytest

from app.cli import main as cli_main
from app.ui.launch import check_exposure, is_loopback, parse_auth, pick_port
from engine.errors import QuickdraftError
from tests.page_server import CHROMIUM_ARGS, chromium, free_port
from tests.paths import ROOT

START_TIMEOUT_S = 240  # importing torch + gradio and loading the model on a busy 2-core box
REPLY_TIMEOUT_MS = 180_000


# -- launch rules -------------------------------------------------------------------------

def test_only_loopback_is_served_without_a_login():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    check_exposure("127.0.0.1", None)
    check_exposure("0.0.0.0", ("me", "secret"))
    with pytest.raises(QuickdraftError, match="--auth USER:PASSWORD"):
        check_exposure("0.0.0.0", None)
    assert parse_auth("me:se:cret") == ("me", "se:cret")
    for bad in ("me", ":pw", "me:"):
        with pytest.raises(QuickdraftError, match="USER:PASSWORD"):
            parse_auth(bad)


def test_the_command_refuses_an_open_host_without_credentials(capsys):
    assert cli_main(["--host", "0.0.0.0", "--no-browser"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --host 0.0.0.0 makes the app reachable") and "--auth" in err
    assert len(err.strip().splitlines()) == 1


def test_a_taken_port_moves_on_unless_asked_for():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(QuickdraftError, match=f"port {port} on 127.0.0.1 is in use"):
            pick_port("127.0.0.1", port)
        with mock.patch("app.ui.launch.DEFAULT_PORT", port):
            assert pick_port("127.0.0.1", None) > port


# -- the app in a browser -----------------------------------------------------------------

@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    """`python launcher.py --no-browser --port P` with its own data folder."""
    chromium()
    data = tmp_path_factory.mktemp("app-data")
    port = free_port()
    log_path = data / "app.log"
    # an empty shipped folder, as in every test: Kangaroo starts "not trained" here
    env = {**os.environ, "QUICKDRAFT_NO_BOOTSTRAP": "1", "QUICKDRAFT_DATA_DIR": str(data),
           "QUICKDRAFT_SHIPPED_DIR": str(tmp_path_factory.mktemp("shipped")),
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        # the eager lean step: compiling it would take the CPU the test runs on
        proc = subprocess.Popen([sys.executable, str(ROOT / "launcher.py"), "--no-browser",
                                 "--port", str(port), "--step", "eager", "--quant", "int4"],
                                cwd=ROOT, env=env,
                                stdout=log,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_until_up(url, proc, log_path)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_until_up(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the app exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"the app did not come up in {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def browser(app_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chrome = p.chromium.launch(executable_path=chromium(), headless=True,
                                   args=CHROMIUM_ARGS)
        yield chrome
        chrome.close()


@pytest.fixture
def page(browser, app_url):
    page = browser.new_page(viewport={"width": 1400, "height": 960})
    page.set_default_timeout(60_000)
    page.goto(app_url)
    page.wait_for_selector("#qd-msg textarea")
    page.wait_for_selector("#qd-conversations input:checked")  # the page has restored state
    yield page
    page.close()


def _set(page, elem_id: str, value) -> None:
    """Type into the number box of a slider."""
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def _send(page, text: str) -> None:
    page.fill("#qd-msg textarea", text)
    page.click("#qd-send")


def _bot_texts(page) -> list[str]:
    return [m.inner_text().strip() for m in page.locator("#qd-chatbot [data-testid=bot]").all()]


# A reply that repeats much of its prompt: Lookup drafting shines on it.
TYPO_PROMPT = ("Fix the typos in this paragraph and write it out in full: The quick brown fox "
               "jumpd over the lazzy dog while the farmer watchd from the porch. Later that "
               "evening, the fox came bak to the farm and looked for the chikens.")

# Reply number N (1-based) is streaming with more than M characters: the count matters, as
# the previous reply is the last bubble until the new one appears.
STREAMING = """() => {
    const bots = document.querySelectorAll('#qd-chatbot [data-testid=bot]');
    const live = document.querySelector('#qd-readout .qd-live');
    return live && bots.length == %d && bots[bots.length - 1].innerText.trim().length > %d;
}"""


@pytest.mark.browser
def test_chat_streams_stops_and_is_restored(page):
    page.click("#qd-new")
    _set(page, "qd-temperature", 0)
    _set(page, "qd-max-new", 24)
    _send(page, "Say hello in one short sentence.")
    page.wait_for_function(STREAMING % (1, 0), timeout=REPLY_TIMEOUT_MS)  # text while it streams
    page.wait_for_selector("#qd-readout .qd-done", timeout=REPLY_TIMEOUT_MS)
    tps = page.inner_text("#qd-readout .qd-tps")
    assert page.locator("#qd-accel input[value=auto]").is_checked()  # the default
    assert page.inner_text("#qd-readout .qd-method") == "Auto"
    assert page.inner_text("#qd-readout .qd-sources").startswith("steps: ")  # what drafted
    assert float(re.match(r"([\d.]+) tok/s", tps).group(1)) > 0
    first = _bot_texts(page)[-1]
    assert first

    _set(page, "qd-max-new", 600)
    _send(page, "Write a 500-word essay about the history of bread.")
    page.wait_for_function(STREAMING % (2, 40), timeout=REPLY_TIMEOUT_MS)
    page.click("#qd-stop")
    page.wait_for_selector("#qd-readout .qd-done:has-text('stopped')", timeout=REPLY_TIMEOUT_MS)
    partial = _bot_texts(page)[-1]
    assert len(partial) > 40
    tokens = int(re.search(r"(\d+) tokens", page.inner_text("#qd-readout .qd-done")).group(1))
    assert tokens < 600

    page.reload()
    page.wait_for_selector("#qd-conversations input:checked")
    page.wait_for_function("() => document.querySelectorAll("
                           "'#qd-chatbot [data-testid=bot]').length == 2")
    assert _bot_texts(page) == [first, partial]
    users = [m.inner_text().strip() for m in page.locator("#qd-chatbot [data-testid=user]").all()]
    assert users == ["Say hello in one short sentence.",
                     "Write a 500-word essay about the history of bread."]
    assert page.locator("#qd-conversations label:has-text('Say hello')").count() == 1


@pytest.mark.browser
def test_acceleration_switch_and_compare(page):
    page.click("#qd-new")
    page.click("#qd-accel label:has(input[value=kangaroo])")  # not trained for this model
    page.wait_for_selector("#qd-accel-status:has-text('not trained')")
    assert page.locator("#qd-train-open").is_visible()
    assert page.locator("#qd-accel input[value=auto]").is_checked()  # the choice stays Auto
    page.click("#qd-train-open")
    page.wait_for_selector("#qd-train-start", state="visible")
    assert page.locator("#qd-train-method input[value=kangaroo]").is_checked()
    page.click("button[role=tab]:has-text('Chat')")

    # Lookup drafts from text already in the conversation: nothing to train.
    page.click("#qd-accel label:has(input[value=lookup])")
    page.wait_for_selector("#qd-accel-status:has-text('ready')")
    assert not page.locator("#qd-train-open").is_visible()
    _set(page, "qd-temperature", 0)
    _set(page, "qd-max-new", 60)
    _send(page, TYPO_PROMPT)
    page.wait_for_selector("#qd-readout .qd-done", timeout=REPLY_TIMEOUT_MS)
    assert page.inner_text("#qd-readout .qd-method") == "Lookup"
    assert "tokens/step" in page.inner_text("#qd-readout")
    page.wait_for_selector("#qd-hist-plot", state="visible")  # the plots after the reply

    page.click("#qd-compare")
    ratio = page.wait_for_selector("#qd-compare-out .qd-ratio", timeout=REPLY_TIMEOUT_MS)
    assert re.fullmatch(r"\d+\.\d\d×", ratio.inner_text().strip())
    verdict = page.inner_text("#qd-compare-out")
    assert "identical text" in verdict or "texts differ" in verdict
    assert re.search(r"Off [\d.]+ tok/s", verdict) and re.search(r"Lookup [\d.]+ tok/s", verdict)
    shot = os.environ.get("QUICKDRAFT_SCREENSHOT")
    if shot:
        page.screenshot(path=shot, full_page=True)


@pytest.mark.browser
def test_a_second_request_waits_with_its_queue_position(browser, app_url, page):
    page.click("#qd-new")
    _set(page, "qd-max-new", 400)
    _send(page, "Write a 500-word essay about the history of bread.")
    page.wait_for_function(STREAMING % (1, 0), timeout=REPLY_TIMEOUT_MS)
    other = browser.new_page()
    try:
        other.goto(app_url)
        other.wait_for_selector("#qd-conversations input:checked")
        other.click("#qd-new")
        _send(other, "Hello!")
        other.wait_for_selector(r"#qd-chatbot >> text=/queue: \d+\/\d+/")
        page.click("#qd-stop")
        other.wait_for_selector("#qd-readout .qd-done", timeout=REPLY_TIMEOUT_MS)
    finally:
        other.close()
