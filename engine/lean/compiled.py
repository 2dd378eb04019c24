"""Compiled layer calls at fixed step sizes, ahead of time: the pure layer function is
exported once per size (torch.export, the attended window and the cache's capacity left
symbolic) and compiled by AOTInductor into a package of C++ kernels and a C++ wrapper. A call
then goes straight into C++ with the layer's tensors: no Python per operation and no guard
checks, which on a small model cost more than the arithmetic.

Packages are kept in the user cache folder under a key of everything they were built for
(the model's layer shapes and dtypes, torch, the CPU and its feature flags), so only the
first start on a machine pays for compiling; a later start loads them in milliseconds.
They are built by a process of their own (engine/lean/builder.py) that outlives the one
that asked. Until every size is ready (or where compiling fails: no C++ compiler, an
unsupported operation) the eager layer serves, and the state says so in one line."""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine import devices
from engine.lean import builder
from engine.lean.builder import Kind
from engine.lean.layer import LayerWeights, StepInputs
from engine.paths import cache_dir, use_inductor_cache

log = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16)  # tokens per compiled step; a draft is padded to the next one
# What compile() does where packages are missing: "load" nothing (use only what is built);
# "watch": start a builder process and load its packages once it is done, decoding eagerly
# meanwhile; "wait": start it and wait (timings then measure the compiled step); "detach":
# start it for the next start and stay eager (a process about to end)
MODES = ("load", "watch", "wait", "detach")


def size_for(n: int) -> int | None:
    """The compiled size a step of n tokens is padded to (None: larger than any)."""
    return next((s for s in SIZES if s >= n), None)


class Steps:
    """The layer call for each step size: loaded packages where ready, else the eager
    function. `for_size` returns call(i, *StepInputs) running layer i (its weights are the
    ones given here)."""

    def __init__(self, layer: Callable, weights: list[LayerWeights]):
        self.layer, self.weights = layer, weights
        kinds: dict[tuple, Kind] = {}
        keys = []
        for w in weights:
            kind = Kind(w)
            keys.append(kinds.setdefault(kind.key, kind).key)
        self.kinds = list(kinds.values())
        self.kind_of = [list(kinds).index(key) for key in keys]  # layer -> its kind
        # Each layer's tensors flattened once, in the order its package takes them.
        self.flat = [self.kinds[k].flat(w) for k, w in zip(self.kind_of, weights, strict=True)]
        self.ready: dict[int, list[Callable]] = {}  # size -> each kind's package runner
        self.failed = ""  # why compiling failed, once it has
        self.compiling = False
        self.seconds: float | None = None  # how long loading or compiling every size took
        self.builder = None  # the builder process this one started (subprocess.Popen)

    def state(self) -> str:
        """Which step runs: what the Models tab and a reply's stats show."""
        if len(self.ready) == len(SIZES):
            return "lean-compiled"
        if self.failed:
            return "lean-eager (compiling failed)"
        return "lean-compiling" if self.compiling else "lean-eager"

    def for_size(self, n: int, start: int) -> tuple[Callable, int]:
        """(layer call, padded size) for a step of n tokens after `start` cached slots. A
        step of up to the largest size runs padded to the next one, compiled or eager
        alike: the same rows through the same kernels, so switching from the eager step to
        the compiled one changes no logit (see build_package)."""
        size = size_for(n)
        if size is None or start + size < 2:  # packages take windows of two slots or more
            return self.eager, n
        runners = self.ready.get(size)
        if runners is None:
            return self.eager, size
        # Straight into a package's C++ runner with a flat list of tensors (its Python
        # wrapper would flatten and check the arguments' structure on every call).
        runs = [r.loader.boxed_run for r in runners]
        kind_of, flat = self.kind_of, self.flat
        return (lambda i, *args: runs[kind_of[i]]([*args, *flat[i]])[0]), size

    def eager(self, i: int, *inputs) -> torch.Tensor:
        """Layer i over a step's StepInputs, eagerly."""
        return self.layer(self.weights[i], *inputs)

    def compile(self, example: Callable[[int], StepInputs], key: str, layout: dict,
                mode: str = "watch", on_ready: Callable[[], None] | None = None,
                report: Callable | None = None) -> None:
        """Load the package of every size and kind (`key` names what they are built for);
        where some are missing, `mode` says what to do (MODES): build them in a builder
        process (engine/lean/builder.py) from `layout` (the layer function's description)
        and `example(size)` (a step's arguments, weights excluded). `on_ready` is called
        once every size is ready here; `report(builder.Status)` hears a build's progress."""
        if mode not in MODES:
            raise ValueError(f"unknown compile mode {mode!r}: one of {', '.join(MODES)}")
        if self.compiling or self.ready or self.failed:
            return
        use_inductor_cache()  # loading a package compiles helpers there
        folder = package_folder(key)
        if all(self._path(folder, size, k).is_file() for size in SIZES
               for k in range(len(self.kinds))):
            self._load(folder, on_ready)  # milliseconds
            return
        if mode == "load":
            return
        proc = builder.start(folder, self._request(example, layout, folder))
        self.builder = proc or self.builder
        if mode == "detach":  # built for the next start; this process stays eager
            return
        self.compiling = True
        work = lambda: self._await(folder, proc, on_ready, report)  # noqa: E731
        if mode == "watch":
            threading.Thread(target=work, daemon=True, name="quickdraft-compile").start()
        else:
            work()

    def _request(self, example: Callable[[int], StepInputs], layout: dict, folder: Path
                 ) -> dict:
        """What the builder needs: the layer's description, one layer's weights per kind
        and a step's arguments per size (shapes and dtypes), and the packages' names."""
        return {**layout,
                "kinds": [builder.describe(kind.example) for kind in self.kinds],
                "examples": {str(size): builder.describe(example(size)) for size in SIZES},
                "packages": [(size, k, self._path(folder, size, k).name) for size in SIZES
                             for k in range(len(self.kinds))]}

    def _await(self, folder: Path, proc, on_ready, report) -> None:
        """Wait for the builder, then load what it built (or keep eager, saying why)."""
        status = builder.wait(folder, proc, report)
        if status.state != "done":
            self.failed = status.error or "the builder failed"
            self.compiling = False
            log.warning("compiling the decode step failed, decoding eagerly: %s", self.failed)
            return
        self._load(folder, on_ready)

    def _load(self, folder: Path, on_ready: Callable[[], None] | None) -> None:
        begin = time.perf_counter()
        try:
            ready = {size: [torch._inductor.aoti_load_package(str(self._path(folder, size, k)))
                            for k in range(len(self.kinds))] for size in SIZES}
            self.ready = ready  # all sizes at once: a reply's steps all run the same way
            self.seconds = time.perf_counter() - begin
            log.info("compiled decode steps loaded in %.2f s", self.seconds)
        except Exception as exc:  # noqa: BLE001 - a bad package leaves the eager layer
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.failed = f"{type(exc).__name__}: {first}"[:300]
            log.warning("loading the compiled decode step failed, decoding eagerly: %s",
                        self.failed)
        finally:
            self.compiling = False
        if self.ready and on_ready is not None:
            on_ready()

    def _path(self, folder: Path, size: int, kind: int) -> Path:
        digest = hashlib.sha256(repr(self.kinds[kind].key).encode()).hexdigest()[:8]
        return folder / f"layer-{size}-{digest}.pt2"


def package_folder(key: str) -> Path:
    """Where the packages built for `key` live: the user cache, under a digest of `key`,
    this layout, torch and the CPU (its capability and feature flags: inductor compiles for
    -march=native, so a package built on another CPU could use instructions this one lacks)."""
    return cache_dir() / "compiled" / _digest(key)


@functools.cache
def layout() -> str:
    """What a package's arithmetic is made of, digested: the layer function's module, the
    low-bit dispatch it traces through and how the builder compiles it. A change to any of
    them keys new packages (the old ones are never loaded for it), with no number to bump."""
    from engine.lean import layer
    from engine.weights import lowbit

    parts = (inspect.getsource(layer), inspect.getsource(lowbit),
             inspect.getsource(builder.build_package),
             inspect.getsource(builder.eager_arithmetic), repr(builder.EAGER_OPS))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def _digest(key: str) -> str:
    """The folder name for packages built for `key` (with this layout, torch and CPU)."""
    full = f"{key}|layout {layout()}|{devices.machine().build_key}"
    return hashlib.sha256(full.encode()).hexdigest()[:16]
