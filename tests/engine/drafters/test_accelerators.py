"""Medusa checkpoints: a saved accelerator loads back as the same drafter, and every kind of
bad checkpoint is refused with one clear line that names the fix."""

from __future__ import annotations

import json

import pytest
import torch

from app.cli import main
from engine.config import SamplingParams
from engine.decode.generate import run
from engine.decode.tree import greedy_tree
from engine.drafters.accelerators import INFO, WEIGHTS, save_checkpoint
from engine.drafters.medusa import MedusaHeads, MedusaSettings
from engine.drafters.registry import load_source
from engine.errors import AcceleratorError
from tests.conftest import make_tiny_model

TREE = [list(c) for c in greedy_tree([[0.5, 0.2], [0.3, 0.1], [0.2], [0.1]], 8)]
FIX = "python launcher.py train --method medusa"


def _save(lm, tree=TREE, num_heads: int = 4, vocab_ids=None, **extra_settings):
    heads = MedusaHeads(int(lm.model.config.hidden_size), MedusaSettings(num_heads), vocab_ids)
    with torch.no_grad():
        heads.weight.normal_(0, 0.01, generator=torch.Generator().manual_seed(0))
    settings = {
        **heads.settings.to_json(),
        # calibration's counted chances: a node of depth d kept half as often as its parent
        "candidates": [[c, 0.5 ** len(c)] for c in tree],
        "pays": bool(tree),
        **extra_settings,
    }
    return heads, save_checkpoint(
        lm, "medusa", heads.tensors(), settings, {"top1": [0.1] * num_heads}
    )


@pytest.fixture(autouse=True)
def _own_data_dir(tmp_path, monkeypatch):
    """Each test starts with no stored accelerators."""
    monkeypatch.setenv("QUICKDRAFT_DATA_DIR", str(tmp_path / "data"))


@pytest.fixture
def lm(bundled_tokenizer):
    return make_tiny_model("llama-gqa", bundled_tokenizer, seed=11)


def test_saved_heads_load_back_and_decode_like_plain_greedy(lm):
    heads, folder = _save(lm)
    drafter = load_source(lm, "medusa")
    assert torch.equal(drafter.heads.weight, heads.weight)
    assert [list(c) for c in drafter.tree.choices[1:]] == sorted(TREE, key=lambda c: (len(c), c))
    params = SamplingParams(max_new_tokens=20)
    assert run(lm, [5, 6, 7], params, drafter)[1] == run(lm, [5, 6, 7], params)[1]
    info = json.loads((folder / INFO).read_text())
    assert info["fingerprint"] == lm.fingerprint and info["kind"] == "medusa"


def test_a_draft_vocabulary_round_trips(lm):
    _save(lm, vocab_ids=torch.tensor([2, 7, 11, 500]))
    drafter = load_source(lm, "medusa")
    assert drafter.heads.vocab_ids.tolist() == [2, 7, 11, 500]
    params = SamplingParams(max_new_tokens=12)
    assert run(lm, [5, 6, 7], params, drafter)[1] == run(lm, [5, 6, 7], params)[1]


def test_a_draft_vocabulary_outside_the_model_is_refused(lm):
    _save(lm, vocab_ids=torch.tensor([2, 10**6]))
    with pytest.raises(AcceleratorError, match="draft vocabulary does not fit.*" + FIX):
        load_source(lm, "medusa")


def test_an_older_checkpoint_drafts_the_greedy_tree_of_its_accuracies(lm):
    """Saved before calibration counted node chances: its per-head accuracies give the
    candidate tree and the chances (independent heads), priced here like any other."""
    accuracies = [[0.9, 0.95], [0.8, 0.9], [0.7, 0.8], [0.6, 0.7]]
    _heads, folder = _save(lm, accuracies=accuracies)
    info = json.loads((folder / INFO).read_text())
    del info["settings"]["candidates"]
    (folder / INFO).write_text(json.dumps(info))
    drafter = load_source(lm, "medusa")
    assert drafter.ranked[0] == (0,) and drafter.chances[0] == pytest.approx(0.9)
    params = SamplingParams(max_new_tokens=16)
    assert run(lm, [5, 6, 7], params, drafter)[1] == run(lm, [5, 6, 7], params)[1]


def test_no_trained_heads_names_the_command(lm):
    with pytest.raises(AcceleratorError, match=FIX):
        load_source(lm, "medusa")


def test_heads_of_another_model_are_refused(lm):
    _heads, folder = _save(lm)
    info = json.loads((folder / INFO).read_text())
    (folder / INFO).write_text(
        json.dumps({**info, "fingerprint": "0123456789abcdef", "base_model_id": "someone/else"})
    )
    with pytest.raises(AcceleratorError, match="built for another model .someone/else.*" + FIX):
        load_source(lm, "medusa")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_or_truncated_weights_are_refused(lm, damage):
    _heads, folder = _save(lm)
    path = folder / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(
        {
            "garbage": b"not a safetensors file" * 10,
            "truncated": data[: len(data) // 2],
            "empty": b"",
        }[damage]
    )
    with pytest.raises(AcceleratorError, match="corrupt or truncated.*" + FIX):
        load_source(lm, "medusa")


def test_a_newer_format_is_refused(lm):
    _heads, folder = _save(lm)
    info = json.loads((folder / INFO).read_text())
    (folder / INFO).write_text(json.dumps({**info, "version": 99}))
    with pytest.raises(AcceleratorError, match="newer than this Quickdraft"):
        load_source(lm, "medusa")


def test_weights_of_the_wrong_shape_are_refused(lm):
    _heads, folder = _save(lm, num_heads=4)
    info = json.loads((folder / INFO).read_text())
    info["settings"]["num_heads"] = 5  # the description no longer fits the weights
    (folder / INFO).write_text(json.dumps(info))
    with pytest.raises(AcceleratorError, match="do not fit this model"):
        load_source(lm, "medusa")


def test_unreadable_settings_are_refused(lm):
    _heads, folder = _save(lm)
    info = json.loads((folder / INFO).read_text())
    info["settings"]["candidates"] = [[[0], "often"]]
    (folder / INFO).write_text(json.dumps(info))
    with pytest.raises(AcceleratorError, match="unreadable settings"):
        load_source(lm, "medusa")


def test_a_tree_deeper_than_the_heads_is_refused(lm):
    _save(lm, tree=[[0], [0, 0], [0, 0, 0]], num_heads=2)
    with pytest.raises(AcceleratorError, match="deeper than the 2 heads.*" + FIX):
        load_source(lm, "medusa")


def test_chat_without_trained_heads_prints_one_line(capsys):
    code = main(["chat", "--prompt", "hi", "--accel", "medusa", "--quant", "bf16",
                 "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert (
        err[-1].startswith("error: no medusa accelerator is trained for this model")
        and FIX in err[-1]
    )
    assert not any("Traceback" in line for line in err)



def _save_crashing_before_the_new_folder_is_in(lm, monkeypatch, folder):
    """A save killed between its two renames (SystemExit: nothing in save may clean up)."""
    real_rename = type(folder).rename

    def rename(self, target):
        if ".tmp-" in self.name:
            raise SystemExit("power cut")
        return real_rename(self, target)

    with monkeypatch.context() as patch:
        patch.setattr(type(folder), "rename", rename)
        with pytest.raises(SystemExit):
            _save(lm, tree=TREE[:2])


def test_a_crash_between_the_two_renames_brings_the_previous_accelerator_back(lm, monkeypatch):
    """Saving moves the old folder aside, then the new one in: a crash between the two leaves
    only <folder>.old, and the next start loads it."""
    heads, folder = _save(lm)
    _save_crashing_before_the_new_folder_is_in(lm, monkeypatch, folder)
    assert not folder.exists() and folder.with_name(folder.name + ".old").is_dir()
    drafter = load_source(lm, "medusa")  # the next start
    assert torch.equal(drafter.heads.weight, heads.weight)
    assert (folder / INFO).is_file() and not folder.with_name(folder.name + ".old").exists()


def test_a_second_crashing_save_does_not_delete_the_only_copy(lm, monkeypatch):
    heads, folder = _save(lm)
    folder.rename(folder.with_name(folder.name + ".old"))  # the state a crash leaves
    _save_crashing_before_the_new_folder_is_in(lm, monkeypatch, folder)
    assert torch.equal(load_source(lm, "medusa").heads.weight, heads.weight)
