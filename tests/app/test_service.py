"""The app's service layer with the real engine on a tiny model: streaming replies, Stop,
queued requests, accelerator switching, model loading, Compare and training jobs."""

from __future__ import annotations

import itertools
import json
import shutil
import threading
from types import SimpleNamespace

import pytest

from app.replies import ReplyRequest
from app.service import Service
from app.store import Store, StoreError
from engine.config import ModelSpec, SamplingParams
from engine.decode import generate as generate_mod
from engine.decode.chat_template import conversation, encode
from engine.decode.generate import run
from engine.drafters.accelerators import checkpoint_dir
from engine.drafters.registry import load_drafter
from engine.errors import AcceleratorError, ModelLoadError, PromptError, QuickdraftError
from tests.conftest import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def _ask(conv_id, params=GREEDY, method="off", **kw) -> ReplyRequest:
    return ReplyRequest(conv_id, params, method, **kw)


def _reply(service, conv_id, prompt, params=GREEDY, method="off"):
    return list(service.replies.chat(_ask(conv_id, params, method), prompt))[-1]


def _reference(lm, prompt, history=(), params=GREEDY) -> str:
    ids = encode(lm.tokenizer, conversation(prompt, list(history)))
    return run(lm, ids, params)[0]


def test_reply_streams_and_is_saved(service, tiny, monkeypatch):
    ticks = itertools.count()  # injected timings: each clock reading is one second later
    monkeypatch.setattr(generate_mod, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    conv = service.store.new()
    updates = list(service.replies.chat(_ask(conv.id), "Tell me about rain"))
    last = updates[-1]
    assert last.done and not any(u.done for u in updates[:-1])
    assert len(updates) > 2  # streamed, one update per model step
    # Read at the start, at the prefill's end and once per step after it (the first
    # token's included): the engine's figures, which every update and the readout share.
    assert last.stats.ttft_s == 1 and last.stats.elapsed_s == last.stats.steps + 2
    assert updates[0].stats.ttft_s == 2  # live, until the engine's own: the first token
    assert updates[-2].stats.tokens == last.stats.tokens - 1
    assert last.stats.tokens_per_s == pytest.approx(last.stats.tokens / (last.stats.steps + 2))
    assert len(last.stats.accepted) == last.stats.steps and set(last.stats.accepted) == {0}
    text = last.conversation.messages[-1]["content"]
    assert text == _reference(tiny, "Tell me about rain")
    saved = service.store.get(conv.id)
    assert saved.title == "Tell me about rain"
    assert saved.messages[-1]["content"] == text
    assert saved.messages[-1]["stats"]["tokens"] == last.stats.tokens


def test_empty_prompt_is_refused_before_anything_is_saved(service):
    conv = service.store.new()
    with pytest.raises(PromptError):
        service.replies.chat(_ask(conv.id), "   ")
    assert service.store.get(conv.id).messages == []


def test_stop_keeps_the_partial_reply(service):
    conv = service.store.new()
    long = SamplingParams(temperature=0.0, max_new_tokens=400)
    seen = []
    for update in service.replies.chat(_ask(conv.id, long), "Write a long story"):
        seen.append(update.conversation.messages[-1]["content"])
        if len(seen) == 4:
            service.replies.stop()
    assert update.done and update.stats.stop_reason == "cancelled"
    assert 0 < update.stats.tokens < 400
    saved = service.store.get(conv.id).messages
    assert [m["role"] for m in saved] == ["user", "assistant"]
    assert saved[-1]["content"] == seen[-1] != ""
    assert saved[-1]["stats"]["stop_reason"] == "cancelled"
    # the next reply is not affected by the earlier Stop
    assert _reply(service, conv.id, "again").stats.stop_reason == "length"


def test_consumer_leaving_mid_reply_saves_and_frees_the_model(service):
    conv = service.store.new()
    stream = service.replies.chat(_ask(conv.id, SamplingParams(max_new_tokens=200)), "hello")
    for _ in range(3):
        partial = next(stream).conversation.messages[-1]["content"]
    stream.close()  # the browser tab went away
    assert not service.host.busy
    assert service.store.get(conv.id).messages[-1]["content"] == partial


def test_two_requests_run_one_after_the_other(service, tiny):
    """The second request waits for the first (no interleaved steps) and both replies are
    exactly what each would be alone; on one conversation the turns stay in order."""
    conv = service.store.new()
    log: list[tuple[str, bool]] = []
    first_started = threading.Event()

    def client(name, prompt):
        for update in service.replies.chat(_ask(conv.id), prompt):
            log.append((name, update.done))
            first_started.set()

    a = threading.Thread(target=client, args=("a", "first question"))
    a.start()
    first_started.wait(60)
    assert service.host.busy
    b = threading.Thread(target=client, args=("b", "second question"))
    b.start()
    a.join(60)
    b.join(60)
    names = [name for name, _ in log]
    assert names == sorted(names)  # every "a" update before every "b" update
    assert log[names.index("b") - 1] == ("a", True)
    messages = service.store.get(conv.id).turns()
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["content"] == _reference(tiny, "first question")
    assert messages[3]["content"] == _reference(tiny, "second question", messages[:2])


def test_regenerate_replaces_the_last_reply(service):
    conv = service.store.new()
    _reply(service, conv.id, "hi")
    sampled = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    last = list(service.replies.regenerate(_ask(conv.id, sampled, system="be kind")))[-1]
    messages = service.store.get(conv.id).messages
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[-1]["content"] == last.conversation.messages[-1]["content"]
    assert service.store.get(conv.id).system == "be kind"
    empty = service.store.new()
    with pytest.raises(StoreError, match="nothing to regenerate"):
        list(service.replies.regenerate(_ask(empty.id)))


def test_switching_acceleration_untrained_offers_training(service):
    off = service.accels.status("off")
    assert off.ready and not off.train_needed
    for method in ("medusa", "kangaroo"):
        status = service.accels.status(method)
        assert not status.ready and status.train_needed
        assert "not trained" in status.message
    # a reply asked for with an untrained method still comes, unaccelerated, and says so
    conv = service.store.new()
    last = _reply(service, conv.id, "hi", method="medusa")
    assert last.method == "off" and any("plain decoding" in n for n in last.notices)
    assert service.store.get(conv.id).messages[-1]["accel"] == "off"
    with pytest.raises(QuickdraftError, match="unknown acceleration"):
        service.accels.status("warp")


def test_auto_is_the_default_and_the_reply_names_the_method_it_used(service, tiny):
    assert service.store.load_settings().accel == "auto"
    status = service.accels.status("auto")
    assert status.ready and "else decodes plainly" in status.message
    assert "Train an accelerator" in status.message
    hybrid = service.accels.status("medusa+lookup")  # needs trained Medusa heads
    assert not hybrid.ready and hybrid.train_needed
    conv = service.store.new()
    last = _reply(service, conv.id, "Tell me about rain", method="auto")
    assert last.method == "auto:off"  # its arm: nothing trained pays
    # which sources drafted its steps is in its own stats, not in a line about the method
    assert sum(last.stats.step_kinds.values()) == last.stats.steps
    assert not any("the last reply" in n for n in last.notices)
    assert last.conversation.messages[-1]["content"] == _reference(tiny, "Tell me about rain")
    assert service.store.get(conv.id).messages[-1]["accel"] == last.method


def test_accelerator_for_another_model_is_refused_cleanly(service, tiny):
    folder = checkpoint_dir(tiny.fingerprint, "medusa")
    folder.mkdir(parents=True)
    (folder / "drafter.json").write_text(json.dumps(
        {"kind": "medusa", "version": 1, "fingerprint": "someone-else", "base_model_id": "x"}))
    try:
        status = service.accels.status("medusa")
        assert not status.ready and status.train_needed
        assert "another model" in status.message
    finally:
        (folder / "drafter.json").unlink()
        folder.rmdir()


def test_compare_needs_a_trained_method(service):
    conv = service.store.new()
    with pytest.raises(QuickdraftError, match="choose an acceleration method"):
        list(service.replies.compare(_ask(conv.id, method="off")))
    with pytest.raises(AcceleratorError, match="not trained"):
        list(service.replies.compare(_ask(conv.id, method="medusa")))
    assert not service.host.busy


def test_bad_model_leaves_the_old_one_working(service, tiny, tmp_path):
    conv = service.store.new()
    empty = tmp_path / "empty-model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    for source in (str(tmp_path / "missing"), str(empty), "not a model"):
        with pytest.raises(ModelLoadError):
            service.host.load_model(ModelSpec(source=source))
        assert service.host.lm is tiny
    job = service.host.start_load(ModelSpec(source=str(tmp_path / "missing")))
    assert job.wait(60) and job.state == "failed" and "not found" in job.error
    assert service.host.lm is tiny
    assert _reply(service, conv.id, "still there?").stats.tokens > 0
    assert service.store.load_settings().model == "default"  # a failed load is not remembered


def test_loading_a_model_swaps_it_and_remembers_it(service, tiny, tmp_path):
    folder = tmp_path / "tiny-folder"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    job = service.host.start_load(ModelSpec(source=str(folder), quant="fp32"))
    assert job.wait(120) and job.state == "done", job.error
    assert service.host.lm is not tiny and service.host.lm.fingerprint == tiny.fingerprint
    assert job.progress.stage == "done"
    assert service.store.load_settings().model == str(folder)
    reopened = Service.open(service.store)  # the next launch loads the last model used
    assert reopened.host.lm.model_id == service.host.lm.model_id


def test_stop_only_ends_the_reply_of_the_session_that_asked(service):
    conv = service.store.new()
    ask = _ask(conv.id, SamplingParams(temperature=0.0, max_new_tokens=30), owner="tab-a")

    def reply_with_stop_from(session):
        updates = []
        for update in service.replies.chat(ask, "hello"):
            updates.append(update)
            if len(updates) == 3:
                service.replies.stop(session)
        return updates[-1].stats.stop_reason

    assert reply_with_stop_from("tab-b") == "length"  # another browser tab's Stop
    assert reply_with_stop_from("tab-a") == "cancelled"


def _untrained_medusa(lm, num_heads: int = 2) -> None:
    """Store Medusa heads as they start training (zero residual: each head repeats the
    model's own next-token guess), with the node chances a calibration would store: a
    valid accelerator with modest acceptance."""
    from engine.drafters.accelerators import save_checkpoint
    from engine.drafters.medusa import MedusaHeads, MedusaSettings

    heads = MedusaHeads(int(lm.model.config.hidden_size), MedusaSettings(num_heads))
    save_checkpoint(lm, "medusa", heads.tensors(),
                    {**heads.settings.to_json(), "tree": [[0], [1], [0, 0]],
                     "candidates": [[[0], 0.6], [[0, 0], 0.4], [[1], 0.2]]},
                    {"speedup": 1.25, "pays": True})


def _cheap_heads(monkeypatch, lm) -> None:
    """The heads' own cost and the step costs pinned instead of timed (a tenth of a plain
    step; a flat CPU curve): whether the heads pay must not depend on what else the machine
    is doing, nor on a tiny model whose LM head is most of its step."""
    from engine.decode.timing import StepCost
    from engine.drafters import medusa as medusa_mod

    monkeypatch.setattr(medusa_mod, "step_overhead", lambda lm, d, tokens: 0.1)
    monkeypatch.setitem(lm.step_costs, lm.target.name, StepCost.linear(0.02))


def test_stored_accelerators_are_read_again_only_when_a_checkpoint_changes(service, tiny,
                                                                          monkeypatch):
    import app.drafting as drafting

    reads = []
    real = drafting.describe
    monkeypatch.setattr(drafting, "describe", lambda lm, m: reads.append(m) or real(lm, m))
    for _ in range(3):
        assert not service.accels.status("medusa").ready
    assert reads == ["medusa"]  # read once, kept while nothing changes
    _untrained_medusa(tiny)  # a training run saves its checkpoint
    try:
        assert service.accels.status("medusa").ready and reads == ["medusa", "medusa"]
        medusa, auto = service.accels.drafter("medusa"), service.accels.drafter("auto")
        assert service.accels.drafter("medusa") is medusa  # kept while nothing changes
        _untrained_medusa(tiny)  # retrained: the drafters that load it are rebuilt
        assert service.accels.drafter("medusa") is not medusa
        assert service.accels.drafter("auto") is not auto  # Auto composes Medusa
    finally:
        shutil.rmtree(checkpoint_dir(tiny.fingerprint, "medusa"))
    assert not service.accels.status("medusa").ready  # removed: untrained again


def test_a_stored_accelerator_that_does_not_pay_says_so(service, tiny):
    from engine.drafters.accelerators import save_checkpoint
    from engine.drafters.medusa import MedusaHeads, MedusaSettings

    heads = MedusaHeads(int(tiny.model.config.hidden_size), MedusaSettings(2))
    save_checkpoint(tiny, "medusa", heads.tensors(), {**heads.settings.to_json(), "tree": []},
                    {"speedup": 1.0})  # calibration found no tree faster than plain decoding
    try:
        status = service.accels.status("medusa")
        assert status.ready and "not drafting: it did not beat plain decoding" in status.message
    finally:
        shutil.rmtree(checkpoint_dir(tiny.fingerprint, "medusa"))


def test_trained_accelerator_is_ready_and_compare_reports_a_ratio(service, tiny, monkeypatch):
    _cheap_heads(monkeypatch, tiny)
    _untrained_medusa(tiny)
    try:
        status = service.accels.status("medusa")
        assert status.ready and "1.25×" in status.message
        conv = service.store.new()
        last = _reply(service, conv.id, "Tell me about rain", method="medusa")
        assert last.method == "medusa" and not last.notices
        assert last.conversation.messages[-1]["content"] == _reference(tiny, "Tell me about rain")
        results = list(service.replies.compare(_ask(conv.id, method="medusa")))
        assert results[0].on is None and results[0].off is not None  # Off reported first
        final = results[-1]
        assert final.prompt == "Tell me about rain"
        assert final.identical is True  # greedy decoding is lossless with any drafter
        assert final.ratio > 0 and final.on.tokens == final.off.tokens
        assert final.on.steps <= final.off.steps
    finally:
        shutil.rmtree(checkpoint_dir(tiny.fingerprint, "medusa"))


def _tree_always_wins(monkeypatch, lm):
    """Calibration's counted candidates and measured decoding injected (the heads kept
    often, decoding twice as fast as plain), and the heads' costs pinned: which branch
    training takes is decided here, not by the clock or a tiny model's few answers (the
    decoding itself still runs, exactly as measured)."""
    from trainer.medusa import calibrate_tree as calibrate

    real = calibrate.measure

    def measured(*args, **kwargs):
        figures = real(*args, **kwargs)
        for name, f in figures.items():
            f["speedup"] = {calibrate.PLAIN: 1.0, "medusa": 2.0}.get(name, 0.5)
        return figures

    monkeypatch.setattr(calibrate, "candidates",
                        lambda *args, **kwargs: [[[0], 0.6], [[0, 0], 0.4], [[1], 0.2]])
    monkeypatch.setattr(calibrate, "measure", measured)
    _cheap_heads(monkeypatch, lm)


def _fast_training(max_conversations: int):
    """Options that train Medusa on a tiny model in seconds (few short answers, a small
    calibration)."""
    from trainer.medusa.calibrate_tree import CalibrationConfig
    from trainer.pipeline import TrainOptions
    from trainer.seeds import DataBudget

    return TrainOptions(
        method="medusa", max_minutes=2.0, calibration_seconds=2.0,
        data=DataBudget(max_conversations=max_conversations, batch_size=8, max_new_tokens=12,
                        samples_per_seed=1),
        calibration=CalibrationConfig(nodes=6, positions=64, prompts=1, max_new_tokens=8),
    )


def test_training_cancel_keeps_data_and_the_next_run_resumes(tmp_path, monkeypatch,
                                                             bundled_tokenizer):
    from trainer.selfdistill import data_path

    monkeypatch.setenv("QUICKDRAFT_DATA_DIR", str(tmp_path / "data"))
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, seed=1)
    _tree_always_wins(monkeypatch, lm)
    service = Service(Store(), lm)

    first = service.training.start(_fast_training(24))
    with pytest.raises(QuickdraftError, match="already in progress"):
        service.training.start(_fast_training(24))
    # Cancel once the first conversation is written (answers under way are dropped).
    while first.running and not (first.progress and first.progress.stage == "data"
                                 and first.progress.done > 0):
        first.wait(0.05)
    service.training.cancel()
    assert first.wait(120) and first.state == "cancelled" and first.result.cancelled
    kept = data_path(lm).read_text().splitlines()
    assert 0 < len(kept) < 24
    assert not service.accels.status("medusa").ready

    second = service.training.start(_fast_training(24))
    assert second.wait(300), "training did not finish"
    assert second.state == "done", second.error
    assert data_path(lm).read_text().splitlines()[: len(kept)] == kept  # resumed, not redone
    assert second.result.data["new"] == 24 - len(kept)
    assert second.result.data["conversations"] == 24
    assert second.history and "loss" in str(second.history[-1])  # live figures for the plots
    assert service.accels.status("medusa").ready  # usable from the selector right away
    assert service.store.load_settings().accel == "auto"  # which now has Medusa to choose from
    assert load_drafter(lm, "medusa").pays_off  # the tree calibration was made to keep
    assert "else drafts with Medusa." in service.accels.status("auto").message
    conv = service.store.new()
    reply = _reply(service, conv.id, "hi", method="medusa")
    assert reply.method == "medusa" and sum(reply.stats.drafted) > 0
    assert reply.conversation.messages[-1]["content"] == _reference(lm, "hi")  # still exact
