"""Whole decode steps replayed as CUDA graphs. On a GPU a small or mid-size model's step is
bound by launching its kernels (some ten per layer, each a few microseconds of Python and
driver), not by their arithmetic; a captured graph launches them all in one call.

A graph records the addresses it reads and writes, so a step's inputs are copied into
tensors the graph owns, attention runs over the cache's whole capacity (the mask hides the
slots not in use: shapes never change between steps), and a graph belongs to one cache's
tensors, which a finished reply hands to the next (LeanTarget.new_cache; zeroed as it is
taken: a stale NaN would pass the mask, engine/lean/cache.py). The first step of each size
and layer range on those tensors captures (one extra step's time); later ones, in later
replies too, replay. A cache that grows drops its graphs (engine/lean/cache.py).

Every graph of a target allocates from one memory pool (`new_pool`), not one pool each (a
target holds some thirty graphs: step sizes times layer ranges). Sharing is safe because
the target runs one graph at a time (LeanTarget's lock) on one stream, a graph's
intermediates are dead once it ends, and each replay's output is copied out before the next
replay is queued: a graph whose blocks another reuses finds overwritten only what nobody
reads any more. Inputs and cache tables are made outside any capture, never in the pool.

Without CUDA the same static steps run eagerly over the same buffers (capture False):
how the suite checks the buffers, the full-capacity masks and the invalidation on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StaticStep:
    """One step's body over tensors it owns: `values` are copied in before each run and
    the outputs (same-shaped states) handed back as fresh tensors (the graph's own are
    overwritten next time), stacked inside the step so that one copy brings them all out:
    a step that keeps every layer's states would otherwise launch a copy per layer.
    Captured (where `capture`) into `pool`, new_pool's, shared with the target's other steps."""

    def __init__(self, body: Callable[..., list[torch.Tensor]],
                 values: list[torch.Tensor], capture: bool, pool):
        self.body = body
        self.inputs = [v.clone() for v in values]
        self.graph = None
        if capture:
            # Warm up outside the capture (cuBLAS and the allocator settle there). It
            # writes the cache slots the first replay writes again with the same values.
            side = torch.cuda.Stream(device=values[0].device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body(*self.inputs)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: the app's other threads may use CUDA meanwhile (they would
            # otherwise break the capture)
            with torch.cuda.graph(self.graph, pool=pool.id, capture_error_mode="thread_local"):
                self.output = torch.stack(body(*self.inputs))

    def __call__(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        for static, value in zip(self.inputs, values, strict=True):
            static.copy_(value)
        if self.graph is None:
            return list(torch.stack(self.body(*self.inputs)).unbind(0))
        self.graph.replay()
        return list(self.output.clone().unbind(0))


def new_pool(device: torch.device):
    """The memory pool a target's graphs share on a GPU (None elsewhere: nothing captured).
    A MemPool object rather than a bare `graph_pool_handle()`: it holds the pool open while
    no graph does (a grown cache drops all its graphs), where capturing into a handle's pool
    after its last graph died fails PyTorch's allocator's check that the pool is in use."""
    if device.type != "cuda":
        return None
    with torch.cuda.device(device):
        return torch.cuda.MemPool()


def replay(graphs: dict, key: tuple, body: Callable[..., list[torch.Tensor]],
           values: list[torch.Tensor], pool) -> list[torch.Tensor]:
    """Run the step `key` names from `graphs` (a cache's), capturing it first where it is
    new, into `pool` (new_pool's); captured on CUDA, run eagerly over the same buffers
    elsewhere."""
    step = graphs.get(key)
    if step is None:
        step = graphs[key] = StaticStep(body, values, values[0].device.type == "cuda", pool)
    return step(values)
