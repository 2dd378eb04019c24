"""Weights' memory (engine/weights/pages.py): large buffers 2 MiB aligned and advised for huge
pages on Linux, small ones ordinary tensors; either way a plain writable CPU tensor."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from engine.weights import pages


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (Linux's /proc/self/smaps)."""
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                found = start <= address < end
            elif found and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_buffer_is_aligned_advised_and_holds_what_is_written():
    shape = (3, pages.HUGE // 2 + 5)  # more than a huge page, not a whole number of them
    buffer = pages.weight_buffer(shape)
    assert buffer.shape == shape and buffer.dtype == torch.uint8 and buffer.is_contiguous()
    buffer.copy_(torch.arange(buffer.numel(), dtype=torch.int64).remainder(251)
                 .to(torch.uint8).view(shape))
    assert torch.equal(buffer.view(-1)[-7:].long(),
                       torch.arange(buffer.numel() - 7, buffer.numel()).remainder(251))
    if sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
        assert buffer.data_ptr() % pages.HUGE == 0
    # a kernel built without transparent huge pages refuses the advice: ordinary pages
    if os.path.isdir("/sys/kernel/mm/transparent_hugepage") and hasattr(mmap, "MADV_HUGEPAGE"):
        assert "hg" in vm_flags(buffer.data_ptr())  # huge pages asked for


def test_a_small_buffer_is_an_ordinary_tensor_and_other_dtypes_keep_their_shape():
    small = pages.weight_buffer((4, 1000))
    assert small.shape == (4, 1000) and small.dtype == torch.uint8
    if sys.platform.startswith("linux"):
        assert "hg" not in vm_flags(small.data_ptr())
    wide = pages.weight_buffer((pages.HUGE // 4, 2), torch.float32)
    assert wide.shape == (pages.HUGE // 4, 2) and wide.dtype == torch.float32
    wide.fill_(1.5)
    assert wide.sum().item() == pytest.approx(1.5 * wide.numel())
