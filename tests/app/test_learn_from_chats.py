"""Learning from the user's chats and continuing from the stored accelerator: which stored
replies count, that they reach the training split only (and only when asked), and that a
continued run starts from the old weights, learns the chats' kind of prompt, stays exact,
and loses nothing when cancelled."""

from __future__ import annotations

import dataclasses
import importlib
import json
import threading

import pytest
import torch

from app.service import Service
from app.store import Conversation, Store
from engine.config import SamplingParams
from engine.decode.chat_template import conversation, encode
from engine.decode.generate import run
from engine.drafters.accelerators import checkpoint_dir, load_checkpoint
from engine.drafters.kangaroo import KangarooDrafter, KangarooSettings
from engine.drafters.kangaroo_adapter import Adapter
from engine.drafters.medusa import MedusaHeads, MedusaSettings, heads_from_tensors
from engine.drafters.registry import load_source
from tests.conftest import assert_exact_while_drafting, make_tiny_model
from trainer.kangaroo.calibrate_exit import KangarooCalibration
from trainer.kangaroo.train_adapter import KangarooTrainConfig
from trainer.medusa.calibrate_tree import CalibrationConfig
from trainer.medusa.train_heads import MedusaTrainConfig
from trainer.pipeline import TrainOptions, train_accelerator
from trainer.resume import Resume, load_resume, start_from
from trainer.seeds import DataBudget
from trainer.selfdistill import data_path
from trainer.training_loop import TrainConfig

# the module (trainer.medusa exports its train function under the same name)
medusa_train = importlib.import_module("trainer.medusa.train_heads")
pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
DONE = {"stop_reason": "eos", "tokens": 3}


def _reply(text: str, model: str = "fp-a", **extra) -> dict:
    return {"role": "assistant", "content": text, "accel": "off", "model": model,
            "acceptance": "auto", "stats": DONE, **extra}


def _conv(*messages: dict, system: str = "") -> Conversation:
    return Conversation("c1", "t", 0.0, 0.0, system, list(messages))


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


# -- which stored replies count ---------------------------------------------------------
def test_a_conversation_keeps_the_models_own_complete_replies():
    conv = _conv(_user("hi"), _reply("hello"), _user("more"), _reply("sure"), _user("again"),
                 system="Be brief.")
    assert conv.model_turns("fp-a") == [
        {"role": "system", "content": "Be brief."}, _user("hi"),
        {"role": "assistant", "content": "hello"}, _user("more"),
        {"role": "assistant", "content": "sure"}]  # the unanswered last prompt is left out
    assert conv.model_turns("fp-b") == []  # another model's chat


@pytest.mark.parametrize("bad", [
    _reply("cut", stats={"stop_reason": "cancelled"}),  # stopped part-way
    _reply("lost", stats=None),  # interrupted before its stats were saved
    _reply("   "),  # empty
    _reply("other", model="fp-b"),  # another model wrote it
    {"role": "assistant", "content": "old", "accel": "off", "stats": DONE},  # unattributed
    _reply("typ", accel="medusa", acceptance="typical"),  # drafts kept without the model
])
def test_a_conversation_ends_before_a_reply_that_is_not_the_models_own(bad):
    conv = _conv(_user("a"), _reply("first"), _user("b"), bad, _user("c"), _reply("later"))
    turns = conv.model_turns("fp-a")
    assert [m["content"] for m in turns] == ["a", "first"]


def test_typical_acceptance_without_drafting_is_the_models_own_reply():
    conv = _conv(_user("a"), _reply("plain", acceptance="typical"))
    assert conv.model_turns("fp-a")[-1]["content"] == "plain"


# -- the app hands them to training -----------------------------------------------------
@pytest.fixture
def lm(bundled_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("QUICKDRAFT_CACHE_DIR", str(tmp_path / "cache"))
    return make_tiny_model("qwen2", bundled_tokenizer, num_layers=2)


def _chat_with(service: Service, prompt: str, fingerprint: str | None = None) -> None:
    from app.replies import ReplyRequest

    conv = service.store.new()
    ask = ReplyRequest(conv.id, SamplingParams(temperature=0.0, max_new_tokens=6))
    list(service.replies.chat(ask, prompt))
    if fingerprint:  # as if another model had written it
        conv = service.store.get(conv.id)
        conv.messages[-1]["model"] = fingerprint
        service.store.save(conv)


class _Captured:
    """Stands in for train_accelerator: keeps the options a run was started with."""

    def __init__(self):
        self.options: list[TrainOptions] = []

    def __call__(self, lm, options, progress=None, cancel=None):
        self.options.append(options)
        return options  # what the command prints is not under test here


def test_chats_with_this_model_reach_training_unless_turned_off(lm, monkeypatch):
    import trainer.pipeline

    captured = _Captured()
    monkeypatch.setattr(trainer.pipeline, "train_accelerator", captured)
    service = Service(Store(), lm)
    _chat_with(service, "Tell me about rain")
    _chat_with(service, "Tell me about snow", fingerprint="another-model")
    rain = next(c for c in service.store.list() if c.title == "Tell me about rain")
    assert rain.messages[-1]["model"] == lm.fingerprint  # the reply says who wrote it
    for use in (True, False):
        job = service.training.start(TrainOptions("medusa"), learn_from_chats=use)
        assert job.wait(30) and job.state == "done", job.error
    with_chats, without = captured.options
    assert [c[0]["content"] for c in with_chats.chats] == ["Tell me about rain"]
    assert with_chats.chats[0][1]["role"] == "assistant" and with_chats.chats[0][1]["content"]
    assert without.chats == ()


def test_the_command_learns_from_chats_unless_no_chats(lm, monkeypatch):
    import app.commands.train as command
    import trainer.pipeline
    from app.cli import main

    captured = _Captured()
    monkeypatch.setattr(trainer.pipeline, "train_accelerator", captured)
    monkeypatch.setattr(command, "load", lambda args, compiled="load": lm)
    monkeypatch.setattr(command, "summary", lambda result: "")
    _chat_with(Service(Store(), lm), "Tell me about rain")
    assert main(["train", "--method", "medusa"]) == 0
    assert main(["train", "--method", "kangaroo", "--no-chats", "--continue"]) == 0
    first, second = captured.options
    assert len(first.chats) == 1 and not first.continue_training
    assert second.chats == () and second.continue_training


# -- continuation -----------------------------------------------------------------------
def test_start_from_loads_fitting_tensors_and_refuses_others_in_one_line(lm):
    stored = Adapter.from_model(lm.model, -1, torch.float32)
    with torch.no_grad():
        for p in stored.parameters():
            p.add_(0.5)
    tensors = KangarooDrafter(lm, stored, KangarooSettings(exit_layer=1)).tensors()
    resume = Resume(checkpoint_dir(lm.fingerprint, "kangaroo"), tensors, {"exit_layer": 1})
    options = TrainOptions("kangaroo", resume=resume)
    lines = []

    fresh = Adapter.from_model(lm.model, -1, torch.float32)
    assert start_from(fresh, options, lambda p: lines.append(p.message), "adapter.",
                      exit_layer=1)
    for mine, theirs in zip(fresh.parameters(), stored.parameters(), strict=True):
        assert torch.equal(mine, theirs)

    other_exit = Adapter.from_model(lm.model, -1, torch.float32)
    before = [p.clone() for p in other_exit.parameters()]
    assert not start_from(other_exit, options, lambda p: lines.append(p.message), "adapter.",
                          exit_layer=2)
    other_layout = Adapter.from_model(lm.model, -1, torch.float32)
    other_layout.extra = torch.nn.Linear(3, 3)  # a parameter the checkpoint has not
    assert not start_from(other_layout, options, lambda p: lines.append(p.message), "adapter.")
    assert all(torch.equal(a, b) for a, b in zip(other_exit.parameters(), before, strict=True))
    assert len(lines) == 2 and all("starts fresh" in line for line in lines)
    assert "exit_layer 1" in lines[0] and resume.continued == 1
    assert not start_from(fresh, TrainOptions("kangaroo"))  # nothing to continue from


def test_continuing_without_a_checkpoint_starts_fresh_with_a_notice(lm):
    resume, notice = load_resume(lm, "medusa")
    assert resume is None and notice.startswith("starting fresh: no medusa accelerator")


def _options(**overrides) -> TrainOptions:
    small = dict(
        method="medusa", max_minutes=2.0, heldout_fraction=0.3, calibration_seconds=1.0,
        data=DataBudget(max_conversations=12, batch_size=6, max_new_tokens=8),
        medusa=MedusaTrainConfig(negatives=64, batch_positions=32, eval_positions=64, epochs=6),
        train=TrainConfig(epochs=2),
        calibration=CalibrationConfig(nodes=6, positions=64, prompts=1, max_new_tokens=6),
    )
    return TrainOptions(**{**small, **overrides})


def _pattern_chats(lm, count: int) -> list[list[dict]]:
    """The tiny model's own greedy replies to the few prompts a user keeps asking. A random
    model has no structure to generalise from, so "the same kind of prompt" is the same
    prompts asked again; its replies read like noise to the untrained heads."""
    chats = []
    for i in range(count):
        prompt = f"List the multiples of {i % 4 + 3}, please."
        reply = run(lm, encode(lm.tokenizer, conversation(prompt)), GREEDY)[0]
        chats.append([{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}])
    return chats


def _head1_top1(lm, tensors: dict, convs: list[list[dict]]) -> float:
    """Head 1's top-1 accuracy against the model's greedy token on `convs`' answers."""
    final = int(lm.model.config.num_hidden_layers)
    heads = heads_from_tensors(tensors, int(lm.model.config.hidden_size),
                               int(lm.model.config.vocab_size), MedusaSettings(4, False, 128))
    feats = medusa_train.features_for(lm, convs, [final])
    teacher = medusa_train.teacher_topk(lm, feats.states[final], 1)
    pos, valid = medusa_train.positions(feats, 4)
    inputs = medusa_train.head_inputs(lm, feats, heads)
    return medusa_train.head_accuracies(lm, heads, inputs, teacher, pos, valid, 1)[0][0]


def _pattern_data(lm, count: int) -> TrainOptions:
    """Self-distilled data of the pattern (the model's greedy replies to the few prompts,
    written where generation would put them), and options that train briefly on it."""
    path = data_path(lm)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i, conv in enumerate(_pattern_chats(lm, count)):
            f.write(json.dumps({"key": f"p{i}#0", "tokens": 24, "messages": conv}) + "\n")
    return _options(data=DataBudget(max_conversations=count),  # nothing more to generate
                    medusa=MedusaTrainConfig(negatives=64, batch_positions=32,
                                             eval_positions=64, epochs=3),
                    train=TrainConfig(lr=0.02))


def test_a_continued_run_starts_from_the_old_heads_and_learns_the_chats(lm, monkeypatch):
    brief = _pattern_data(lm, 24)
    first = train_accelerator(lm, brief)
    old = load_checkpoint(lm, "medusa").tensors
    learn, held = _pattern_chats(lm, 12), _pattern_chats(lm, 4)  # held: asked once more
    before = _head1_top1(lm, old, held)

    starts, seen = [], {}
    real_fit, real_train = medusa_train.train_module, medusa_train.train

    def record_start(module, *args, **kwargs):
        starts.append(module.weight.detach().clone())
        return real_fit(module, *args, **kwargs)

    def record_split(lm, train_convs, heldout_convs, *args):
        seen.update(train=train_convs, heldout=heldout_convs)
        return real_train(lm, train_convs, heldout_convs, *args)

    messages = []
    with monkeypatch.context() as patch:
        patch.setattr(medusa_train, "train_module", record_start)
        patch.setattr(importlib.import_module("trainer.medusa.train_heads"), "train", record_split)
        second = train_accelerator(
            lm, dataclasses.replace(brief, chats=tuple(learn), continue_training=True),
            lambda p: messages.append(p.message))
    assert torch.equal(starts[0], old["heads.weight"])  # not the zero start of a fresh run
    assert old["heads.weight"].abs().sum() > 0
    assert seen["train"][-12:] == learn  # the chats are trained on, never held out:
    assert len(seen["heldout"]) == first.data["heldout_conversations"]  # figures comparable
    assert "12 conversations from your chats" in messages
    assert second.data["chat_conversations"] == 12 and second.data["continued"]
    assert second.metrics["chat_conversations"] == 12
    assert second.metrics["continued"]["modules"][0].startswith("continued heads")
    after = _head1_top1(lm, load_checkpoint(lm, "medusa").tensors, held)
    drafter = load_source(lm, "medusa")  # whatever calibration chose, greedy stays exact
    for prompt in ("List the multiples of 3, please.", "Say something."):
        ids = encode(lm.tokenizer, conversation(prompt))
        assert_exact_while_drafting(lm, ids, GREEDY, drafter)

    fresh = train_accelerator(lm, dataclasses.replace(brief, chats=tuple(learn)))
    from_scratch = _head1_top1(lm, load_checkpoint(lm, "medusa").tensors, held)
    print(f"head-1 top-1 on the pattern asked again: {before:.3f} after the brief run, "
          f"{after:.3f} continued, {from_scratch:.3f} fresh with the same budget; held-out "
          f"split: {first.metrics['top1'][0]:.3f} -> {second.metrics['top1'][0]:.3f} "
          f"(fresh {fresh.metrics['top1'][0]:.3f})")
    assert after > before + 0.05 and after > from_scratch  # the head start shows
    assert second.metrics["top1"][0] > first.metrics["top1"][0] + 0.05  # the same held-out


def test_a_cancelled_continued_run_leaves_the_previous_checkpoint(lm):
    first = train_accelerator(lm, _options())
    files = {p.name: p.read_bytes() for p in first.folder.iterdir()}
    cancel = threading.Event()

    def stop_in_training(p) -> None:
        if p.stage == "train":
            cancel.set()

    chats = tuple(_pattern_chats(lm, 4))
    second = train_accelerator(lm, _options(chats=chats, continue_training=True),
                               stop_in_training, cancel)
    assert second.cancelled and second.folder is None
    assert {p.name: p.read_bytes() for p in first.folder.iterdir()} == files


def test_a_continued_kangaroo_run_starts_from_the_stored_adapter(lm, monkeypatch):
    kangaroo = importlib.import_module("trainer.kangaroo.train_adapter")
    options = dataclasses.replace(
        _pattern_data(lm, 16), method="kangaroo",
        kangaroo=KangarooTrainConfig(exit_layers=(1,), epochs=2, draft_vocab=1000, calibration=(
            KangarooCalibration(prompts=1, max_new_tokens=8, repeats=1, seconds=2.0))))
    train_accelerator(lm, options)
    stored = load_checkpoint(lm, "kangaroo").tensors
    starts = []
    real_fit = kangaroo.train_module

    def record_start(module, *args, **kwargs):
        starts.append({k: v.detach().clone() for k, v in module.state_dict().items()})
        return real_fit(module, *args, **kwargs)

    monkeypatch.setattr(kangaroo, "train_module", record_start)
    chats = tuple(_pattern_chats(lm, 4))
    second = train_accelerator(lm, dataclasses.replace(options, chats=chats,
                                                       continue_training=True))
    assert second.metrics["continued"]["modules"][0].startswith("continued adapter")
    for name, value in starts[0].items():  # the stored adapter (kept in the model's dtype)
        assert torch.equal(value, stored[f"adapter.{name}"].to(value.dtype))
    drafter = load_source(lm, "kangaroo").with_schedule(0.0, 3)  # drafting for sure
    ids = encode(lm.tokenizer, conversation("List the multiples of 4, please."))
    assert run(lm, ids, GREEDY, drafter)[1] == run(lm, ids, GREEDY)[1]


def test_the_train_tab_says_chats_are_used_and_retrain_continues(lm, monkeypatch):
    import gradio as gr

    from app.ui.train_tab import CHATS_LABEL, TrainTab

    service = Service(Store(), lm)
    _chat_with(service, "Tell me about rain")
    asked = []
    monkeypatch.setattr(service.training, "start",
                        lambda options, learn_from_chats: asked.append((options,
                                                                         learn_from_chats)))
    monkeypatch.setattr("app.ui.train_tab.readout.job_html", lambda job, error=None: "")
    with gr.Blocks():
        tab = TrainTab(service)
        tab.wire()
    assert tab.chats.value is True and "stay on this computer" in CHATS_LABEL
    assert "1 of your conversations with this model" in tab.refresh()[tab.target]
    tab.start("medusa", 1, None, False)
    tab.retrain("kangaroo", 1, None, True)
    (fresh, fresh_chats), (again, again_chats) = asked
    assert not fresh.continue_training and not fresh_chats
    assert again.continue_training and again_chats and again.method == "kangaroo"


def test_medusa_heads_continue_with_the_draft_vocabulary_of_the_new_data():
    old = MedusaHeads(8, MedusaSettings(2), torch.arange(10, 20))
    with torch.no_grad():
        old.weight.add_(1.0)
    resume = Resume(checkpoint_dir("fp", "medusa"), old.tensors(), {})
    options = TrainOptions("medusa", resume=resume)
    new = MedusaHeads(8, MedusaSettings(2), torch.arange(30, 40))
    assert start_from(new, options, prefix="heads.", fresh=("vocab_ids",))
    assert torch.equal(new.weight, old.weight) and torch.equal(new.vocab_ids, torch.arange(30, 40))
    aligned = MedusaHeads(8, MedusaSettings(2), torch.arange(30, 40))  # nothing kept fresh:
    assert start_from(aligned, options, prefix="heads.")  # the stored vocabulary comes along
    assert torch.equal(aligned.vocab_ids, torch.arange(10, 20))
