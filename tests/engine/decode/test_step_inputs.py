"""A decode step's host inputs (token ids, positions, a tree's mask) reach a GPU from
pinned memory without waiting (engine/devices.py `staged`): checked on a faked GPU."""

from __future__ import annotations

import pytest
import torch

from engine import devices

pytestmark = pytest.mark.usefixtures("one_thread")


def test_staged_inputs_on_a_cpu_are_the_plain_tensors():
    cpu = torch.device("cpu")
    ids = devices.staged([[5, 6, 7]], cpu)
    assert ids.device == cpu and ids.dtype == torch.long and ids.tolist() == [[5, 6, 7]]
    mask = torch.tensor([[True, False], [True, True]])
    assert devices.staged(mask, cpu) is mask  # already there: no copy


class Pinned:
    """A pinned host tensor as `staged` uses one (a CPU build of torch cannot pin)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype
        self.held, self.sent = None, None

    def copy_(self, host: torch.Tensor) -> Pinned:
        self.held = host.clone()
        return self

    def to(self, device, non_blocking=False) -> Pinned:
        self.sent = (device, non_blocking)
        return self


def test_staged_inputs_go_to_a_gpu_from_a_pinned_copy_without_waiting(monkeypatch):
    """A pageable copy may stall the host on the GPU each step: a GPU's inputs come from a
    fresh pinned buffer, sent non_blocking, and the caller's own tensor stays free to
    change."""
    made = []

    def empty(size, *, dtype=None, pin_memory=False):
        made.append(Pinned(size, dtype))
        assert pin_memory, "a GPU's step inputs are staged in pinned memory"
        return made[-1]

    monkeypatch.setattr(torch, "empty", empty)
    gpu = torch.device("cuda", 0)
    positions = devices.staged([9, 10, 10], gpu)
    assert positions is made[-1] and positions.sent == (gpu, True)
    assert positions.held.tolist() == [9, 10, 10] and positions.held.dtype == torch.long
    tree = torch.ones(2, 2, dtype=torch.bool)
    sent = devices.staged(tree, gpu)
    tree[0, 1] = False  # the caller writes its mask again: the copy in flight is not it
    assert sent.sent == (gpu, True) and sent.held.all() and sent.held.dtype == torch.bool
