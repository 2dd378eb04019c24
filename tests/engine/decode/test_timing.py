"""The step-cost curve drafters size their drafts by (engine/decode/timing.py): priced at the size a
step really runs at, timed so that one step's aftermath does not leak into another's, by
CUDA events on a CUDA device, and for sampled replies on a curve of their own."""

from __future__ import annotations

import pytest
import torch

from engine.config import SamplingParams
from engine.decode import timing
from engine.lean import compiled
from tests.conftest import make_tiny_model

CURVE = ((1, 1.0), (2, 1.1), (4, 1.2), (8, 1.6), (16, 2.8))


def test_a_padded_step_is_priced_at_the_size_it_runs_at():
    padded = timing.StepCost(CURVE, pads=compiled.SIZES)
    assert padded(3) == padded(4) == pytest.approx(1.2)
    assert padded(5) == padded(8) == pytest.approx(1.6)
    assert padded(20) == pytest.approx(2.8 + 1.2 / 8 * 4)  # past the last size: extended
    assert timing.StepCost(CURVE)(3) == pytest.approx(1.15)  # unpadded steps: interpolated


def test_lean_steps_say_they_pad(bundled_lm):
    """The lean step runs a step padded to the compiled sizes whether it is eager,
    compiled or graphed (the same arithmetic in all three); transformers' forward runs each
    step at its own size."""
    import dataclasses

    from engine.model.loading import make_target

    assert bundled_lm.target.padded_sizes() == compiled.SIZES
    other = make_target(bundled_lm.model, "transformers", bundled_lm.dtype)
    assert dataclasses.replace(bundled_lm, target=other).target.padded_sizes() == ()


class FakeTimer:
    """Stands in for StepTimer: records the order steps are timed in."""

    order: list[int] = []

    def __init__(self, lm, room, params=None):
        FakeTimer.order = []

    def once(self, n: int) -> float:
        FakeTimer.order.append(n)
        return n / 1000


def test_large_steps_are_timed_after_the_small_ones(monkeypatch, bundled_lm):
    """A large step leaves the CPU slower for the next few: no step is timed just after a
    larger one, except the warm-up's, which is not counted."""
    monkeypatch.setattr(timing, "StepTimer", FakeTimer)
    sizes = (1, 2, 4, 8, 16, 32)
    got = timing.step_seconds(bundled_lm, sizes, rounds=3)
    assert got == {n: n / 1000 for n in sizes}
    timed = FakeTimer.order[len(sizes):]  # after warming every size up, largest first
    assert FakeTimer.order[:len(sizes)] == sorted(sizes, reverse=True)
    small = [n for n in timed if n <= timing.ALTERNATE]
    assert small == [1, 2, 4] * 3 and timed[:9] == small  # in turn, before any large one
    assert timed[9:] == [8] * 4 + [16] * 4 + [32] * 4  # each after one untimed step of it


# -- the clock on each device ------------------------------------------------------------


class FakeEvent:
    """torch.cuda.Event as a card records it: what was recorded where, and 250 ms apart."""

    log: list = []

    def __init__(self, enable_timing: bool = False):
        assert enable_timing  # an event without timing cannot say how long it took

    def record(self, stream=None) -> None:
        FakeEvent.log.append(("record", stream))

    def synchronize(self) -> None:
        FakeEvent.log.append(("synchronize",))

    def elapsed_time(self, end: FakeEvent) -> float:
        return 250.0


def test_a_cuda_call_is_timed_by_events_on_its_stream(monkeypatch):
    from tests.fake_devices import AMPERE, fake_cuda

    fake_cuda(monkeypatch, AMPERE)
    stream = object()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    FakeEvent.log = []
    step = lambda: FakeEvent.log.append(("step",))  # noqa: E731
    assert timing.seconds(torch.device("cuda", 0), step) == 0.25  # the device's own clock
    assert FakeEvent.log == [("record", stream), ("step",), ("record", stream), ("synchronize",)]
    FakeEvent.log = []
    assert timing.seconds(None, step) == 0.25  # the current device: a CUDA one here
    FakeEvent.log = []
    timing.seconds(torch.device("cpu"), step)  # a CPU: the wall clock
    assert FakeEvent.log == [("step",)]


def test_apple_gpu_work_is_waited_for_before_the_clock_stops(monkeypatch):
    log = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: log.append("sync"))
    timing.seconds(torch.device("mps"), lambda: log.append("step"))
    assert log == ["sync", "step", "sync"]


# -- greedy and sampled steps -------------------------------------------------------------


HOT = SamplingParams(temperature=0.7, top_p=0.9)  # the app's default top-p, no top-k


def test_a_sampled_step_verifies_as_a_sampled_reply_does(bundled_tokenizer, monkeypatch):
    """The rows' probabilities under the reply's settings, made as a reply makes them
    (verify.probabilities), then the lossless rule over a chain of stand-in drafts, with
    the acceptance rule's draws on the model's device; a greedy step does neither."""
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=1)
    calls, probs, accept = [], timing.probabilities, timing.accept_pointmass

    def probs_spy(logits, params):
        calls.append(("probs", tuple(logits.shape), logits.dtype, params))
        return probs(logits, params)

    def accept_spy(children, tokens, target_probs, generator):
        calls.append(("accept", children, len(tokens), generator.device.type))
        return accept(children, tokens, target_probs, generator)

    monkeypatch.setattr(timing, "probabilities", probs_spy)
    monkeypatch.setattr(timing, "accept_pointmass", accept_spy)
    sampled, greedy = timing.StepTimer(lm, room=4, params=HOT), timing.StepTimer(lm, room=4)
    calls.clear()
    sampled.once(4)
    vocab = int(lm.model.config.vocab_size)
    assert calls == [("probs", (4, vocab), torch.float32, HOT),
                     ("accept", [[1], [2], [3], []], 4, lm.device.type)]
    calls.clear()
    greedy.once(4)
    timing.StepTimer(lm, params=SamplingParams()).once(2)  # greedy settings: a greedy step
    assert calls == []


def test_sampled_replies_have_their_own_curve_timed_on_first_use(bundled_tokenizer,
                                                                 monkeypatch):
    """Greedy's curve stays where it was (under the target's name); a sampled one is timed
    once per kind of sampling work, not per temperature."""
    lm = make_tiny_model("llama-gqa", bundled_tokenizer, num_layers=1)
    timed = []

    def clock(lm, params=None):
        timed.append(params)
        return {1: 0.01, 2: 0.012} if params is None else {1: 0.02, 2: 0.03}

    monkeypatch.setattr(timing, "step_seconds", clock)
    greedy = timing.step_cost(lm)
    assert timed == [None] and lm.step_costs == {lm.target.name: greedy}
    sampled = timing.step_cost(lm, HOT)
    assert timed == [None, HOT]
    assert greedy(2) == pytest.approx(1.2) and sampled(2) == pytest.approx(1.5)
    assert sampled.plain_s == 0.02  # a sampled plain step is its unit
    assert timing.step_cost(lm, SamplingParams(temperature=1.3, top_p=0.9)) is sampled
    assert timing.step_cost(lm, SamplingParams()) is greedy
    timing.step_cost(lm, SamplingParams(temperature=0.7))  # no top-p sort: other work
    timing.step_cost(lm, SamplingParams(temperature=0.7, top_p=0.9, top_k=40))
    assert len(timed) == 4 and len(lm.step_costs) == 4
