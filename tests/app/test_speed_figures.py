"""Every speed figure the page shows says where it was measured: the Acceleration panel
reports what replies and Compare measured on this machine (marked when the machine was busy),
a ratio below 1 is never green and says what Auto does about it, a source that never drafts
says why, the step breakdown names every source that drafted, and a Compare that differs
only at a rounding tie says so calmly, with the details behind a click."""

from __future__ import annotations

import re

from app.replies import CompareResult
from app.sources import mix_of
from app.speed_record import Measure, SpeedRecord, measure_of
from app.speed_words import measured_lines, ready_line, slower, what_auto_does
from app.ui.readout import compare_html, sources_chip
from engine.decode.drafter import Drafter
from engine.decode.neartie import Divergence
from engine.decode.stats import GenerationStats

NOON = 1_800_000_000.0  # a fixed time.time()


def _stats(tokens_per_s: float, accepted: list[int], kinds: dict | None = None,
           kept: dict | None = None, store: tuple[int, int] = (0, 0)) -> GenerationStats:
    s = GenerationStats(tokens=1 + sum(a + 1 for a in accepted), steps=len(accepted),
                        accepted=accepted, drafted=list(accepted))
    s.elapsed_s = s.tokens / tokens_per_s
    s.step_kinds, s.kind_accepted = kinds or {}, kept or {}
    s.datastore_drafted, s.datastore_accepted = store
    return s


class Paying(Drafter):
    """A trained source's verdict as the panel reads it."""

    def __init__(self, pays: bool, speedup: float):
        self._pays, self.speedup = pays, speedup

    @property
    def pays_off(self) -> bool:
        return self._pays


def test_a_source_that_only_joined_other_steps_is_named_in_the_breakdown():
    stats = _stats(20.0, [1, 1, 1, 1, 1], {"medusa": 3, "medusa+datastore": 2},
                   {"medusa": 3, "medusa+datastore": 2}, store=(2, 2))
    chip = sources_chip(mix_of("auto:medusa", stats.to_json()))
    assert "<b>Medusa 100%</b>" in chip and "datastore joined 2 of them" in chip


def _tie(gap: float, tolerance: float) -> Divergence:
    return Divergence(position=44, expected=11, got=12, gap=gap, tolerance=tolerance)


def test_a_rounding_tie_is_one_calm_line_with_the_details_behind_a_click():
    off, on = _stats(20.0, [0] * 10), _stats(30.0, [1] * 5)
    tie = CompareResult("auto", "Hi", off, on, False, _tie(0.0, 0.922), "bfloat16")
    shown = compare_html(tie)
    assert "same reply up to a rounding tie at token 45" in shown
    assert "qd-differ" not in shown and "qd-mismatch" not in shown and "near-tie (gap" not in shown
    details = re.search(r"<details.*?</details>", shown, re.S).group(0)
    assert "<summary>" in details and "In fp32 the texts are identical" in details
    assert "gap 0, rounding 0.922" in details
    real = compare_html(CompareResult("auto", "Hi", off, on, False, _tie(3.0, 0.922),
                                      "bfloat16"))
    assert "qd-mismatch" in real and "MISMATCH at token 45" in real and "<details" not in real


def test_a_ratio_below_one_is_never_green_and_says_what_auto_does():
    off = _stats(40.0, [0] * 10)
    slow = CompareResult("medusa", "Hi", off, _stats(30.0, [1] + [0] * 8), True, busy=0.6)
    shown = compare_html(slow, "Auto still drafts with Medusa")
    assert 'class="qd-chip qd-ratio qd-slow"' in shown and "slower than Off" in shown
    assert not re.search(r'class="qd-chip qd-ratio"', shown)  # the green chip
    assert "Auto still drafts with Medusa" in shown
    assert "taken while other programs used 60% of the CPU" in shown
    fast = compare_html(CompareResult("medusa", "Hi", off, _stats(60.0, [1] * 5), True))
    assert 'class="qd-chip qd-ratio"' in fast and "slower" not in fast and "other programs" \
        not in fast
    paying, priced_out = Paying(True, 2.38), Paying(False, 0.96)
    assert "Auto leaves Medusa out here" in what_auto_does("medusa", "Medusa", 0.7, priced_out,
                                                           None)
    assert "Auto still drafts with Medusa where its own estimate here (2.38×" in what_auto_does(
        "medusa", "Medusa", 0.7, paying, None)
    assert "0.85× Off" in what_auto_does("auto", "Auto", 0.85, Drafter(), None)


def test_a_run_that_kept_no_draft_shows_its_ratio_as_noise_not_a_gain():
    off = _stats(5.0, [0] * 10)
    for speed in (13.1, 4.0):  # a busy machine timed the same steps either way
        shown = compare_html(CompareResult("medusa", "Hi", off, _stats(speed, [0] * 10), True))
        assert "the same steps as Off, so the difference is timing noise" in shown
        assert 'class="qd-chip qd-ratio qd-plain"' in shown and "slower than Off" not in shown


def test_the_panel_reports_what_replies_and_compare_measured_here():
    record = SpeedRecord()
    assert "Not measured in replies on this machine yet" in measured_lines("medusa", "Medusa",
                                                                           record)[0]
    for busy in (0.05, 0.6, 0.02):  # one of them while another program was busy
        record.add_reply("medusa", measure_of(_stats(30.0, [1, 0, 1, 0]), busy))
    record.add_reply("off", measure_of(_stats(40.0, [0] * 6), 0.0))
    line = measured_lines("medusa", "Medusa", record)[0]
    assert "your last 3 replies with Medusa: 1.50 tokens/step" in line
    assert "Off:" in line and "× Off, on different prompts" in line
    assert "1 of them ran while other programs used over a quarter of the CPU" in line
    assert slower("medusa", record) is not None  # 30 tok/s against Off's 40
    record.add_compare("medusa", Measure(NOON, 1.6, 35.0, 1.0, 0.63, vs_off=1.2))
    compare = measured_lines("medusa", "Medusa", record)[-1]
    assert "while other programs used 63% of the CPU: 1.20× Off on the same prompt" in compare
    assert slower("medusa", record) is None  # the same-prompt figure decides


def test_a_compare_that_kept_no_draft_is_reported_as_noise_not_a_ratio():
    record = SpeedRecord()
    record.add_compare("medusa", Measure(NOON, 1.0, 33.0, 0.0, 0.0, vs_off=0.91))
    line = measured_lines("medusa", "Medusa", record)[-1]
    assert "no draft kept, the same steps as Off, so its 0.91× Off" in line
    assert "timing noise" in line and "tokens/step" not in line
    assert slower("medusa", record) is None  # not a slowdown drafting caused
    replies = SpeedRecord()
    replies.add_reply("medusa", measure_of(_stats(30.0, [0, 0, 0]), 0.0))
    replies.add_reply("off", measure_of(_stats(40.0, [0] * 6), 0.0))
    assert slower("medusa", replies) is None  # replies that drafted nothing, likewise


def test_a_source_that_never_drafts_says_why():
    assert ready_line("Kangaroo", "", Paying(False, 0.96)).startswith(
        "Kangaroo is loaded but not drafting: estimated 0.96× here")
    assert ready_line("Medusa", "", Paying(False, None)).startswith(
        "Medusa is loaded but not drafting: it did not beat plain decoding here")
    assert ready_line("Kangaroo", "", Paying(True, 1.3)) == "Kangaroo is ready."
    record = SpeedRecord()
    record.add_reply("kangaroo", measure_of(_stats(30.0, [0, 0, 0]), 0.0))
    assert any("Kangaroo drafted none of the steps" in line
               for line in measured_lines("kangaroo", "Kangaroo", record))
