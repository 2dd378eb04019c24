"""The whole Medusa build on a tiny model: data -> features -> training -> calibration ->
checkpoint, a cancelled run that resumes, and the `train` command's messages."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import threading
from types import SimpleNamespace

import pytest

from app.cli import main
from app.commands.progress_line import render
from app.commands.train import summary
from engine.config import SamplingParams
from engine.drafters import registry
from engine.errors import QuickdraftError
from engine.progress import Progress
from tests.conftest import assert_exact_while_drafting, make_tiny_model
from trainer import features as features_mod
from trainer.features import conversation_tokens
from trainer.medusa.calibrate_tree import CalibrationConfig, prompts_that_fit
from trainer.medusa.train_heads import MedusaTrainConfig
from trainer.pipeline import LEAST_DATA, TrainOptions, _data_budget, train_accelerator
from trainer.sampler import supports_rows
from trainer.seeds import DataBudget
from trainer.selfdistill import data_path, split_heldout
from trainer.training_loop import TrainConfig


def _options(**overrides) -> TrainOptions:
    small = dict(
        method="medusa",
        max_minutes=2.0,
        heldout_fraction=0.3,
        calibration_seconds=1.0,
        data=DataBudget(max_conversations=12, batch_size=6, max_new_tokens=8),
        medusa=MedusaTrainConfig(negatives=64, batch_positions=32, eval_positions=64),
        train=TrainConfig(epochs=2),
        calibration=CalibrationConfig(nodes=6, positions=64, prompts=1, max_new_tokens=6),
    )
    return TrainOptions(**{**small, **overrides})


@pytest.fixture
def lm(bundled_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    return make_tiny_model("qwen2", bundled_tokenizer, num_layers=2)


def test_a_full_build_saves_heads_that_decode_exactly(lm):
    stages = []
    result = train_accelerator(lm, _options(), lambda p: stages.append(p.stage))
    assert result.folder is not None and not result.cancelled
    assert ["data", "features", "train", "calibrate", "save", "done"] == list(dict.fromkeys(stages))
    assert len(result.metrics["top1"]) == 4 and "data_s" in result.metrics["times"]
    # the stored heads themselves (the "medusa" method decodes plainly where they do not
    # pay): whatever calibration chose, greedy stays exact
    drafter = registry.load_source(lm, "medusa")
    assert_exact_while_drafting(lm, [3, 4, 5], SamplingParams(max_new_tokens=24), drafter)


def test_a_budget_too_short_for_data_still_collects_the_least_and_trains(lm):
    """The smallest budget trains: the time budget does not stop the data stage before the
    file holds the least (train, held-out) conversations the trainer needs."""
    options = _options(max_minutes=0.001, data=DataBudget(max_conversations=400, batch_size=6,
                                                          max_new_tokens=8))
    result = train_accelerator(lm, options, lambda p: None)
    assert result.folder is not None
    train, held = split_heldout(data_path(lm), options.heldout_fraction)
    assert len(train) >= LEAST_DATA[0] and len(held) >= LEAST_DATA[1]
    assert result.data["conversations"] < 400  # it stopped at the least, not the cap


def test_a_cancelled_build_resumes_with_its_data_and_features(lm, monkeypatch):
    cancel = threading.Event()

    def stop_in_training(p: Progress) -> None:
        if p.stage == "train":
            cancel.set()

    first = train_accelerator(lm, _options(), stop_in_training, cancel)
    assert first.cancelled and first.folder is None
    writes = []
    real_write = features_mod._write_shard
    monkeypatch.setattr(features_mod, "_write_shard", lambda *a: writes.append(a) or real_write(*a))
    second = train_accelerator(lm, _options(), lambda p: None)
    assert second.folder is not None and second.data["new"] == 0  # no data made twice
    assert not writes  # every feature shard came from the cache


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"method": "eagle"}, "unknown method"),
        ({"max_minutes": 0}, "positive"),
        ({"prompts_file": "/no/such/prompts.jsonl"}, "prompts file not found"),
    ],
)
def test_bad_options_are_refused(overrides, words):
    with pytest.raises(QuickdraftError, match=words):
        _options(**overrides)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--max-minutes", "0"], "positive"),
        (["--prompts", "/no/such/file.txt"], "prompts file not found"),
    ],
)
def test_the_command_refuses_bad_input_in_one_line(argv, words, capsys):
    assert main(["train", "--method", "medusa", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and words in err[0]


def test_progress_line_shows_stage_fraction_and_eta():
    line = render(Progress("data", 30, 120, "30/120 conversations", eta_s=125), elapsed_s=61)
    assert line.startswith("[data     ] [#######") and " 25% " in line
    assert "elapsed 1:01" in line and "ETA 2:05" in line


def test_progress_line_in_a_log_writes_a_line_per_stage_not_per_report():
    import io

    from app.commands.progress_line import ProgressLine

    log = io.StringIO()
    bar = ProgressLine(log, every_s=3600)
    for done in range(10):
        bar(Progress("bench", done, 10, f"prompt {done + 1}/10"))
    bar(Progress("done", 10, 10, "done"))
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "prompt 1/10" in lines[0] and lines[1].startswith("[done")


def test_summary_says_plainly_when_the_heads_do_not_pay():
    measured = {
        "plain": {"speedup": 1.0, "mean_accepted": 1.0, "tokens_per_s": 20},
        "medusa": {"speedup": 0.83, "mean_accepted": 1.4, "tokens_per_s": 16.6},
    }
    result = SimpleNamespace(
        method="medusa",
        cancelled=False,
        folder="/x",
        data={"conversations": 10, "tokens": 900},
        settings={"tree": [], "pays": False},
        metrics={
            "top1": [0.2, 0.1],
            "top5": [0.4, 0.2],
            "times": {"data_s": 60.0},
            "calibration": {"chosen": "plain", "measured": measured},
        },
    )
    text = summary(result)
    assert "head 1:  20.0% /  40.0%" in text
    assert "do not pay on this machine (measured 0.83x)" in text


@pytest.mark.parametrize("method", ["medusa", "kangaroo"])
def test_the_data_share_leaves_the_features_of_data_and_chats_their_time(lm, method,
                                                                        monkeypatch):
    trainer = importlib.import_module(registry.method(method).trainer)
    options = _options(method=method, max_minutes=10.0)
    # Injected timings: every timed piece lasts one second on its own clock, so the figure is
    # what the division makes of it: the feature forward's tokens (4 rows of min(256, the
    # context) tokens), plus for Medusa one teacher chunk's positions.
    timing = importlib.import_module("engine.decode.timing")
    clocks = [timing] + ([trainer] if method == "medusa" else [])
    for module in clocks:  # the feature forward's clock, and Medusa's teacher chunk's
        ticks = itertools.count()
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=ticks.__next__))
    teacher = 1 / 2048 if method == "medusa" else 0.0
    per_token = trainer.prep_seconds_per_token(lm, options)
    assert per_token == pytest.approx(1 / (4 * min(256, lm.context_len)) + teacher)
    chats = ([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}],)
    timed = SimpleNamespace(prep_seconds_per_token=lambda lm, options: 2.0,
                            feature_layers=lambda lm, options: (1,))
    plain = _data_budget(lm, timed, options, 600.0)
    with_chats = _data_budget(lm, timed, dataclasses.replace(options, chats=chats), 600.0)
    assert plain.max_seconds == pytest.approx(600.0 * options.prep_share)
    # the lean step's rows record the features of the answers they write: those are free
    assert supports_rows(lm) and plain.prep_s_per_token == 0.0 and plain.record_layers == (1,)
    chat_tokens = conversation_tokens(lm, chats[0])
    assert with_chats.max_seconds == pytest.approx(plain.max_seconds - 2.0 * chat_tokens)


def test_calibration_decodes_only_the_prompts_its_time_allows():
    config = CalibrationConfig(prompts=4, max_new_tokens=64)
    assert prompts_that_fit(None, 0.1, 3, config) == 4  # no limit: every prompt
    assert prompts_that_fit(100.0, 0.1, 3, config) == 4  # 19.2 s a prompt: all four fit
    assert prompts_that_fit(40.0, 0.1, 3, config) == 2
    assert prompts_that_fit(1.0, 0.1, 3, config) == 1  # at least one, or nothing is measured


def test_every_trained_method_offers_what_the_pipeline_and_the_train_command_call():
    from engine.drafters.registry import TRAINED, method

    for name in TRAINED:
        trainer = importlib.import_module(method(name).trainer)
        for call in ("check", "feature_layers", "prep_seconds_per_token", "reserve_s", "train",
                     "summary_lines"):
            assert callable(getattr(trainer, call, None)), (name, call)
