"""Fake accelerators for tests on a CPU: torch.cuda's and torch.mps's queries answer as a
given card would (compute capability, name, free and total memory, native bf16), so the
choices made from them (engine/devices.py, engine/weights/memory_fit.py) are checked without one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 2**30


@dataclass(frozen=True)
class FakeCard:
    """A CUDA card as torch reports it."""

    name: str
    capability: tuple[int, int]
    total_gb: float
    free_gb: float


# The classes of cards people own (docs/models.md's table), by compute capability.
PASCAL = FakeCard("NVIDIA GeForce GTX 1060 6GB", (6, 1), 6, 5.5)
TURING = FakeCard("NVIDIA GeForce RTX 2060", (7, 5), 6, 5.5)
AMPERE = FakeCard("NVIDIA GeForce RTX 3060", (8, 6), 12, 11.2)
ADA = FakeCard("NVIDIA GeForce RTX 4090", (8, 9), 24, 23.0)


def fake_cuda(monkeypatch, card: FakeCard) -> None:
    """torch.cuda answers as if `card` were device 0 (only the queries; no kernel runs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: card.capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: card.name)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: (int(card.free_gb * GB), int(card.total_gb * GB)))
    # torch's own rule: native bf16 from compute capability 8.0 (emulated before)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation
                        or card.capability >= (8, 0))
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def no_gpu(monkeypatch, cuda_build: bool = False) -> None:
    """Neither CUDA nor Apple's GPU; torch a CPU build unless `cuda_build`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8" if cuda_build else None)


def fake_mps(monkeypatch, budget_gb: float, bf16: bool) -> None:
    """An Apple GPU with `budget_gb` of working set, running bf16 or not (macOS 13)."""
    from engine import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: int(budget_gb * GB))
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 0)
    monkeypatch.setattr(devices, "mps_runs",
                        lambda dtype: dtype != torch.bfloat16 or bf16)
