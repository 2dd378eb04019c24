"""Accelerators shipped for the bundled model: they load until the user trains their own,
which then takes precedence; Retrain continues from whichever loads; and the files in
assets/accelerators are what a fresh install chats with (Auto over them, greedy exact)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import engine.drafters.accelerators as accelerators
from app.training import training_summary
from engine.config import SamplingParams
from engine.decode.generate import run
from engine.decode.timing import StepCost
from engine.drafters import medusa as medusa_mod
from engine.drafters.accelerators import (
    INFO,
    WEIGHTS,
    checkpoint_dir,
    describe,
    is_shipped,
    load_checkpoint,
)
from engine.drafters.registry import TRAINED, load_drafter, load_source
from tests.conftest import make_tiny_model
from tests.engine.drafters.test_accelerators import _save
from trainer.resume import load_resume

REPO_SHIPPED = accelerators.SHIPPED_DIR
MAX_SHIPPED_BYTES = 30 * 1024 * 1024  # what the repository may carry for them, together


@pytest.fixture
def lm(bundled_tokenizer):
    return make_tiny_model("llama-gqa", bundled_tokenizer, seed=11)


@pytest.fixture
def shipped(lm, tmp_path, monkeypatch):
    """A Medusa accelerator for `lm` moved from the user's folder to a shipped folder."""
    heads, folder = _save(lm)
    target = tmp_path / "shipped"
    target.mkdir()
    shutil.move(folder, target / folder.name)
    monkeypatch.setenv("QUICKDRAFT_SHIPPED_DIR", str(target))
    return heads, target / folder.name


def test_a_shipped_accelerator_loads_when_none_is_trained(lm, shipped, monkeypatch):
    heads, folder = shipped
    assert not (checkpoint_dir(lm.fingerprint, "medusa") / INFO).exists()
    ckpt = load_checkpoint(lm, "medusa")
    assert ckpt.folder == folder and is_shipped(ckpt.folder)
    assert torch.equal(load_source(lm, "medusa").heads.weight, heads.weight)
    assert describe(lm, "medusa")["folder"] == str(folder)
    params = SamplingParams(max_new_tokens=16)
    # its heads' cost and the step costs priced, not timed: whether it pays is not the clock's
    monkeypatch.setattr(medusa_mod, "step_overhead", lambda lm, d, tokens: 0.1)
    monkeypatch.setitem(lm.step_costs, lm.target.name, StepCost.linear(0.02))
    auto = load_drafter(lm, "auto")
    assert auto.used() == "auto:medusa"  # Auto drafts with it from the first reply
    assert run(lm, [5, 6, 7], params, auto)[1] == run(lm, [5, 6, 7], params)[1]


def test_the_users_own_accelerator_takes_precedence(lm, shipped):
    _heads, folder = shipped
    own, own_folder = _save(lm)  # same seed, so tell them apart by folder
    assert load_checkpoint(lm, "medusa").folder == own_folder
    assert not is_shipped(own_folder)
    shutil.rmtree(own_folder)
    assert load_checkpoint(lm, "medusa").folder == folder


def test_retrain_continues_from_the_shipped_accelerator(lm, shipped):
    heads, folder = shipped
    resume, notice = load_resume(lm, "medusa")
    assert notice == "" and resume.folder == folder
    assert torch.equal(resume.tensors["heads.weight"], heads.weight)


def test_the_train_tab_says_which_accelerators_came_shipped(lm, shipped, tmp_path):
    from app.store import Store

    line = training_summary(lm, Store(tmp_path / "store"))
    assert "Medusa: shipped with Quickdraft" in line and "Kangaroo: not trained yet" in line


def test_a_broken_shipped_accelerator_is_refused_like_any_other(lm, shipped):
    _heads, folder = shipped
    (folder / WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(Exception, match="corrupt or truncated"):
        load_checkpoint(lm, "medusa")


# -- the files in the repository --------------------------------------------------------------

def _repo_folders(lm) -> dict:
    return {m: REPO_SHIPPED / f"{lm.fingerprint}-{m}" for m in TRAINED}


@pytest.mark.slow
def test_the_repository_ships_both_accelerators_for_the_bundled_model(bundled_lm):
    folders = _repo_folders(bundled_lm)
    for method, folder in folders.items():
        assert (folder / INFO).is_file(), f"no shipped {method} accelerator in {folder}"
        info = json.loads((folder / INFO).read_text())
        assert info["fingerprint"] == bundled_lm.fingerprint and info["kind"] == method
    size = sum(f.stat().st_size for folder in folders.values() for f in folder.iterdir())
    assert size <= MAX_SHIPPED_BYTES
    heads = load_checkpoint(bundled_lm, "medusa", folders["medusa"]).tensors
    # the draft vocabulary is indices into the model's own LM head, never copied rows
    assert heads["heads.vocab_ids"].dtype == torch.int64
    assert not any(t.shape[-1] == bundled_lm.model.config.vocab_size or
                   (t.dim() == 2 and t.shape[0] == heads["heads.vocab_ids"].numel())
                   for name, t in heads.items() if name != "heads.vocab_ids")
    adapter = load_checkpoint(bundled_lm, "kangaroo", folders["kangaroo"]).tensors
    assert adapter["draft_vocab"].dtype == torch.int64
    assert not any(t.shape[0] == adapter["draft_vocab"].numel()
                   for name, t in adapter.items() if name != "draft_vocab")


@pytest.mark.slow
def test_a_fresh_install_chats_with_auto_over_them_exactly(bundled_lm, monkeypatch):
    from engine.decode.chat_template import conversation, encode

    monkeypatch.setenv("QUICKDRAFT_SHIPPED_DIR", str(REPO_SHIPPED))
    for method in TRAINED:
        assert is_shipped(load_checkpoint(bundled_lm, method).folder)
    auto = load_drafter(bundled_lm, "auto")  # over those that pay in fp32 here
    params = SamplingParams(max_new_tokens=48)
    ids = encode(bundled_lm.tokenizer, conversation("Write a short poem about rain."))
    assert run(bundled_lm, ids, params, auto)[1] == run(bundled_lm, ids, params)[1]
