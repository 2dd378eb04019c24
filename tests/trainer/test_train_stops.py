"""A training run that stops early — cancelled while extracting features or while
calibrating, or left with too little data — saves nothing: the accelerator trained before
stays as it was, loadable, and the run says so in one line."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from app.commands.train import summary
from engine.drafters import medusa as md
from engine.drafters.accelerators import load_checkpoint, save_checkpoint, stored_dir
from engine.drafters.kangaroo import Adapter, KangarooDrafter, KangarooSettings
from engine.drafters.registry import load_drafter
from engine.errors import QuickdraftError
from engine.model.loading import fingerprint
from tests.conftest import make_tiny_model
from trainer.kangaroo.calibrate_exit import KangarooCalibration
from trainer.kangaroo.train_adapter import KangarooTrainConfig
from trainer.medusa.calibrate_tree import CalibrationConfig
from trainer.medusa.train_heads import MedusaTrainConfig
from trainer.pipeline import TrainOptions, train_accelerator
from trainer.seeds import DataBudget
from trainer.training_loop import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def lm(bundled_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    return make_tiny_model("qwen2", bundled_tokenizer, num_layers=2)


def _options(method: str, conversations: int = 10) -> TrainOptions:
    return TrainOptions(
        method=method, max_minutes=2.0, heldout_fraction=0.3, calibration_seconds=1.0,
        data=DataBudget(max_conversations=conversations, batch_size=5, max_new_tokens=8),
        medusa=MedusaTrainConfig(negatives=64, batch_positions=32, eval_positions=64),
        kangaroo=KangarooTrainConfig(exit_layers=(1,), epochs=1, draft_vocab=200,
                                     calibration=KangarooCalibration(prompts=1,
                                                                     max_new_tokens=6,
                                                                     repeats=1)),
        train=TrainConfig(epochs=1),
        calibration=CalibrationConfig(nodes=6, positions=64, prompts=1, max_new_tokens=6),
    )


def _previous(lm, method: str) -> dict[str, bytes]:
    """An accelerator trained before this run (marked by its speedup, 1.23); returns its
    files' bytes."""
    if method == "medusa":
        heads = md.MedusaHeads(int(lm.model.config.hidden_size), md.MedusaSettings(2))
        tensors, settings = heads.tensors(), {**heads.settings.to_json(), "tree": [[0]]}
    else:
        drafter = KangarooDrafter(lm, Adapter(lm.model), KangarooSettings(1, 0.0, 2))
        tensors, settings = drafter.tensors(), drafter.settings.to_json()
    settings |= {"pays": True, "quant": lm.quant, "device": lm.device.type}
    folder = save_checkpoint(lm, method, tensors, settings, {"speedup": 1.23, "pays": True})
    return _files(folder)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _still_there(lm, method: str, before: dict[str, bytes]) -> None:
    folder = stored_dir(fingerprint(lm.model), method)
    assert _files(folder) == before  # not a byte changed
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no leftovers
    assert load_checkpoint(lm, method).metrics["speedup"] == 1.23  # the one trained before
    assert load_drafter(lm, method).used()  # and it still loads as a drafter


@pytest.mark.parametrize("method, stage", [("medusa", "features"), ("kangaroo", "features"),
                                           ("medusa", "calibrate"), ("kangaroo", "calibrate")])
def test_a_cancel_leaves_the_previous_accelerator_as_it_was(lm, method, stage):
    before = _previous(lm, method)
    cancel, stages = threading.Event(), []

    def progress(p) -> None:
        stages.append(p.stage)
        if p.stage == stage:
            cancel.set()

    result = train_accelerator(lm, _options(method), progress, cancel)
    assert set(stages[stages.index(stage):]) == {stage}  # stopped there, saving nothing
    assert result.cancelled and result.folder is None
    assert summary(result) == ("cancelled: run the same command again to resume (the "
                               "accelerator trained before is unchanged)")
    _still_there(lm, method, before)


@pytest.mark.parametrize("method", ["medusa", "kangaroo"])
def test_too_little_data_is_one_line_and_saves_nothing(lm, method):
    before = _previous(lm, method)
    stages = []
    with pytest.raises(QuickdraftError) as info:
        train_accelerator(lm, _options(method, conversations=2), lambda p: stages.append(p.stage))
    message = str(info.value)
    assert message.startswith("too little training data (") and "\n" not in message
    assert "held out" in message and "--max-minutes" in message  # says how to get more
    assert set(stages) == {"data"}  # refused before features, training or saving
    _still_there(lm, method, before)
