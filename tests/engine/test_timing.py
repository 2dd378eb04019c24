"""The step-cost curve drafters size their drafts by (engine/timing.py): priced at the size a
step really runs at, and timed so that one step's aftermath does not leak into another's."""

from __future__ import annotations

import pytest

from engine import timing
from engine.lean import compiled

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

    from engine.loading import make_target

    assert bundled_lm.target.padded_sizes() == compiled.SIZES
    other = make_target(bundled_lm.model, "transformers", bundled_lm.dtype)
    assert dataclasses.replace(bundled_lm, target=other).target.padded_sizes() == ()


class FakeTimer:
    """Stands in for StepTimer: records the order steps are timed in."""

    order: list[int] = []

    def __init__(self, lm, room):
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
