"""What a page event can send is anything JSON holds: every value is checked where it enters
and refused in one line, never saved, never a raw Python message. And what the page says about
speed: where each figure comes from, Compare's warning about repeated text, and accelerators
built for the model that is loaded now, not for the one a swap replaced."""

from __future__ import annotations

import re
import time
import warnings

import gradio as gr
import pytest

from app.replies import CompareResult
from app.service import Service
from app.settings_rules import SettingError, page_choice, page_number, page_text
from app.speed_words import Taken, speed_words
from app.store import Store
from app.ui.chat_tab import ChatTab
from app.ui.readout import compare_html
from engine.decode.drafter import Drafter
from engine.decode.stats import GenerationStats
from tests.conftest import make_tiny_model


@pytest.fixture
def tab(tmp_path, bundled_tokenizer):
    service = Service(Store(tmp_path / "data"), make_tiny_model("llama-mha", bundled_tokenizer))
    with gr.Blocks():
        return ChatTab(service)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), None, "0.5", True, [1], 1e-300])
def test_a_number_from_the_page_is_a_finite_number_in_range(value):
    with pytest.raises(SettingError) as refused:
        page_number("temperature", value)
    assert str(refused.value).startswith("temperature must be")
    assert page_number("temperature", 0) == 0 and page_number("top_k", 40.0, integer=True) == 40
    with pytest.raises(SettingError, match="whole number"):
        page_number("top_k", 2.5, integer=True)


def test_text_and_choices_from_the_page_are_checked():
    assert page_text("the message", None) == ""
    for bad in ("hi \ud800", 12):
        with pytest.raises(SettingError, match="^the message "):
            page_text("the message", bad)
    with pytest.raises(SettingError, match="must be one of"):
        page_choice("the acceleration", None, ("auto", "off"))


def test_events_with_hostile_values_answer_one_line_and_save_nothing(tab):
    before = tab.service.store.settings_path.read_bytes() if \
        tab.service.store.settings_path.exists() else b""
    out = list(tab.send("hi", "", "", float("nan"), 0.9, 0, 8, "auto", "off", None))
    assert out == [{tab.readout: '<div class="qd-error">temperature must be a finite number</div>',
                    tab.queued: ""}]
    out = list(tab.send("hi \ud800", "", "", 0.0, 0.9, 0, 8, "auto", "off", None))
    assert "lone surrogate" in out[0][tab.readout]
    status = tab.select_accel(None, "auto")
    assert status[tab.accel] == "auto" and status[tab.accel_status].startswith("⚠ the accel")
    tab._saver("max_new_tokens")(float("nan"))  # a warning on the page, nothing saved
    tab.save_system("", "\ud800")
    after = tab.service.store.settings_path.read_bytes() if \
        tab.service.store.settings_path.exists() else b""
    assert after == before
    assert tab.new_conv("", "\ud800") == {} and tab.service.store.list() == []


def test_a_training_run_asked_with_hostile_values_is_refused_in_one_line(tab):
    from app.ui.train_tab import TrainTab

    with gr.Blocks():
        train = TrainTab(tab.service)
    for method, minutes in (("medusa", float("nan")), (None, 5), ("medusa", "5")):
        status, _timer = train.start(method, minutes, None, True)
        assert status.startswith('<div class="qd-error">') and "Error" not in status
    assert tab.service.training.job is None


def test_speed_figures_say_where_when_and_under_what_load_they_were_taken():
    assert speed_words("Medusa", 1.4, None, False) == (
        "Medusa: Calibration measured 1.40× when it was trained.")
    at = time.mktime((2026, 12, 7, 14, 2, 0, 0, 0, -1))
    idle = speed_words("Kangaroo", 1.4, 1.16, True, Taken(at, 0.05))
    assert idle == ("Kangaroo: estimated 1.16× plain decoding when the model loaded (at 14:02); "
                    "calibration measured 1.40× on the machine it was built on.")
    busy = speed_words("Kangaroo", 1.4, 2.38, True, Taken(at, 0.63))
    assert "(at 14:02, while other programs used 63% of the CPU)" in busy
    assert "Taken on a busy machine" in busy


def test_the_auto_status_is_about_the_method_never_a_past_reply(tab):
    service = tab.service
    conv = service.store.new()
    from app.replies import ReplyRequest
    from engine.config import SamplingParams

    ask = ReplyRequest(conv.id, SamplingParams(max_new_tokens=6), "auto")
    list(service.replies.chat(ask, "one two one two one two"))
    status = service.accels.status("auto").message
    assert "last reply" not in status and "%" not in status


def _stats(kinds: dict, kept: dict, tokens_per_s: float) -> GenerationStats:
    steps = sum(kinds.values())
    s = GenerationStats(tokens=20, steps=steps, elapsed_s=20 / tokens_per_s,
                        accepted=[1] * steps, drafted=[2] * steps)
    s.step_kinds, s.kind_accepted = kinds, kept
    return s


def test_compare_warns_when_most_of_the_gain_repeated_earlier_text():
    off = _stats({}, {}, 10.0)
    copied = _stats({"copy": 9, "medusa+lookup": 1}, {"copy": 9, "medusa+lookup": 1}, 30.0)
    shown = compare_html(CompareResult("auto", "Say it again", off, copied, True))
    assert "3.00×" in shown and "steps: <b>copies from this conversation 90%</b>" in shown
    assert "90% of the drafted tokens" in shown and "mostly from repetition" in shown
    fresh = _stats({"copy": 1, "medusa+lookup": 9}, {"copy": 1, "medusa+lookup": 9}, 15.0)
    assert "repetition" not in compare_html(CompareResult("auto", "New", off, fresh, True))


def test_a_drafter_built_while_the_model_was_swapped_is_not_kept(tab, bundled_tokenizer,
                                                                  monkeypatch):
    service = tab.service
    other = make_tiny_model("llama-gqa", bundled_tokenizer)
    built = []

    def load(lm, method, source):  # the swap happens while this build runs
        built.append(lm)
        if len(built) == 1:
            with service.host.lock:
                service.host._lm = other
                for forget in service.host.on_swap:
                    forget()
        return Drafter()

    monkeypatch.setattr("app.drafting.compose", load)
    service.accels.drafter("lookup")  # built for the model that was loaded when it started
    service.accels.drafter("lookup")
    assert built[-1] is other  # asked again, it is built for the model loaded now


def test_the_console_leaves_out_a_librarys_warning_about_itself_and_keeps_the_rest():
    from app.cli import quiet_library_warnings

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        quiet_library_warnings()
        for _ in range(5):  # torch's pytree, once per compiled step
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance("
                          "treespec, TreeSpec) and treespec.is_leaf()` instead.", FutureWarning,
                          stacklevel=1)
        warnings.warn("something a user can act on", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in shown] == ["something a user can act on"]


def test_a_training_figure_its_progress_line_gives_is_not_printed_again():
    from app.jobs import Job
    from app.ui.readout import job_html
    from engine.progress import Progress

    job = Job("train", "Medusa for tiny", "medusa")
    job.progress = Progress("train", 50, 100, "step 50/100, loss 4.250; held-out head 1 top-1 "
                            "22.7%", 30.0, {"loss": 4.25, "head 1 top-1": 0.227, "lr": 0.0004})
    figures = re.search(r'qd-job-figures">(.*?)</div>', job_html(job)).group(1)
    assert figures == "lr 0.0004"  # 22.7% and 0.227 are one figure: said once


def test_the_pages_errors_speak_of_its_controls_not_the_command_line():
    from app.ui.readout import page_words

    assert page_words("too little training data (13 conversations, 0 held out): give training "
                      "more time with --max-minutes") == (
        "too little training data (13 conversations, 0 held out): give training more time "
        "with the Time budget slider")
    assert page_words("--max-minutes must be a positive number").startswith("the time budget")
    stale = page_words("Medusa cannot be used: built for another layout; retrain it: run: "
                       "python launcher.py train --method medusa")
    assert "launcher" not in stale and "train it again on the Train accelerator tab" in stale
