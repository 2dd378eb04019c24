"""The page's speed figures in Chromium: the Acceleration panel shows what this machine's
replies and Compare measured, a Compare slower than Off is not green and says what Auto does,
and a rounding tie reads as one calm line whose details open on a click."""

from __future__ import annotations

import pytest

from engine.decode.neartie import Divergence
from engine.decode.stats import GenerationStats
from tests.page_server import REPLY_MS, send

pytestmark = pytest.mark.browser
GREEN = "rgb(209, 250, 229)"  # .qd-ratio's background when faster


def _replayed(tokens_per_s: float, ids: list[int], kept: int = 0
              ) -> tuple[list[int], GenerationStats]:
    """Injects timings: a greedy replay's tokens and figures, as Compare's runs return them
    (`kept`: drafts its first step kept)."""
    stats = GenerationStats(tokens=len(ids), steps=len(ids) - 1,
                            accepted=[kept] + [0] * (len(ids) - 2),
                            drafted=[1] * (len(ids) - 1), stop_reason="length")
    stats.elapsed_s = len(ids) / tokens_per_s
    return ids, stats


def test_the_panel_and_compare_show_what_was_measured_here(site, page, monkeypatch):
    service = site[0]
    send(page, "Tell me about rain", 1)
    panel = page.inner_text("#qd-accel-status")
    assert "Measured here, your last" in panel and "tokens/step" in panel

    runs = iter([_replayed(40.0, [5, 6]), _replayed(40.0, [5, 6]),  # the untimed warm-ups
                 _replayed(40.0, [5, 6, 7, 8]), _replayed(30.0, [5, 6, 9, 8], kept=1)])
    monkeypatch.setattr(service.replies.core, "replay", lambda *args: next(runs))
    monkeypatch.setattr("app.replies.neartie.measure", lambda *args: Divergence(2, 7, 9, 0.0,
                                                                                0.5))
    page.click("#qd-compare")
    ratio = page.wait_for_selector("#qd-compare-out .qd-ratio", timeout=REPLY_MS)
    assert ratio.inner_text().strip() == "0.75×"
    assert page.evaluate("e => getComputedStyle(e).backgroundColor", ratio) != GREEN
    shown = page.inner_text("#qd-compare-out")
    assert "slower than Off" in shown and "Auto" in page.inner_text("#qd-compare-out .qd-slower")
    assert "same reply up to a rounding tie at token 3" in shown
    assert not page.locator("#qd-compare-out details[open]").count()  # behind a click
    assert not page.locator("#qd-compare-out details p, #qd-compare-out details").first \
        .evaluate("d => d.open")
    page.click("#qd-compare-out details summary")
    assert "In fp32 the texts are identical" in page.inner_text("#qd-compare-out details")
    page.wait_for_selector("#qd-accel-status:has-text('0.75× Off on the same prompt')")
