"""Memory for weights that a decode step reads in full: on Linux, backed by 2 MiB pages
(transparent huge pages, asked for with madvise) where the system gives them.

A step of a 0.5B model on its GGUF blocks streams ~0.4 GB of weights: ~100,000 pages of
4 KiB, each a TLB miss and a page walk (two-level under a virtual machine's nested paging),
while the hardware prefetcher stops at every page's end. In 2 MiB pages the same bytes are
~200 pages. Where the system has no such pages (another OS, THP set to "never", memory too
fragmented) the same buffer is ordinary memory: only the speed differs, never the values.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE = 2 << 20  # bytes of a huge page (x86-64 and most arm64 Linux kernels)
MIN_BYTES = HUGE  # smaller tensors stay ordinary memory: a huge page would be mostly padding


def weight_buffer(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialized CPU tensor of `shape` for weights that are read every step: 2 MiB
    aligned in memory the kernel is asked to back with huge pages (at least MIN_BYTES;
    smaller ones, or on systems without madvise's MADV_HUGEPAGE, a plain torch.empty)."""
    size = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if size < MIN_BYTES or advice is None:
        return torch.empty(shape, dtype=dtype)
    # private and anonymous (not MAP_SHARED, mmap's default, which is shmem with its own THP
    # setting); the advice comes before any page is touched, so the pages are faulted huge
    region = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # THP compiled out: ordinary pages, the same buffer
        pass
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` mapped while alive
    start = -whole.data_ptr() % HUGE
    return whole[start:start + size].view(dtype).view(shape)
