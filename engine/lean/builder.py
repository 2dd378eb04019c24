"""Builds the compiled lean step's packages (engine/lean/compiled.py) in a process of its own:

    python -m engine.lean.builder FOLDER

Compiling takes about a minute of every core, so it runs apart from the process that asked
for it: that process keeps decoding on the eager step (no shared interpreter lock slows its
replies), may end before the build does (a one-shot `chat`), and the packages are kept for
every later start all the same. A request file in the package folder says what to build:
the layer function's description (LeanSpec, the wide-rows threshold) and the shapes, strides
and dtypes of one layer's weights per kind and of a step's arguments per size; the builder
compiles on zeros of those shapes (the weights are arguments of the package, not
constants), so it never loads the model. It writes its progress to a status file beside
the packages, which the asking process reads (`wait`), and holds a lock on the folder while
it works, so two starts asking at once build once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from engine.lean.layer import SYMBOLIC, LayerWeights, Projection, StepInputs
from engine.paths import atomic_write, use_inductor_cache
from engine.weights.lowbit import LowBitWeights

log = logging.getLogger(__name__)

REQUEST = "request.json"  # what to build (written by the asking process)
STATUS = "status.json"  # the builder's progress: Status as JSON
LOCK = ".build.lock"  # held by the builder at work
LOG = "build.log"  # the builder's own output, for when it fails
ROOT = Path(__file__).resolve().parents[2]  # the project: `-m engine.lean.builder` runs here


@dataclasses.dataclass(frozen=True)
class Status:
    """Where a build stands."""

    state: str  # "building" | "done" | "failed"
    done: int = 0  # packages built so far
    total: int = 0  # packages this build makes
    elapsed_s: float = 0.0  # since the builder started
    eta_s: float | None = None  # seconds left, once a package is built
    error: str = ""  # one line, when failed
    pid: int = 0  # the builder's process

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed")


# --- the asking process -----------------------------------------------------------------


def start(folder: Path, request: dict) -> subprocess.Popen | None:
    """Start a builder for `folder` with `request`, detached from this process (its own
    session: Ctrl-C in the terminal or this process ending does not stop it); None when
    one is building that folder already."""
    status = read(folder)
    if status is not None and status.state == "building" and _alive(status.pid):
        return None
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / REQUEST, lambda tmp: tmp.write_text(json.dumps(request)))
    _write(folder, Status("building"))  # not an earlier build's end: the builder's pid follows
    with open(folder / LOG, "ab") as out:
        detached = ({"start_new_session": True} if os.name == "posix" else
                    {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP
                     | subprocess.DETACHED_PROCESS})
        proc = subprocess.Popen([sys.executable, "-m", "engine.lean.builder", str(folder)],
                                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                **detached)
    # Its pid at once, so that a process waiting on the folder sees it alive before it
    # writes its own status (it imports torch first).
    found = read(folder)
    if found is not None and found.state == "building" and found.pid == 0:
        _write(folder, Status("building", pid=proc.pid))
    return proc


def read(folder: Path) -> Status | None:
    """The folder's build status; None when no build was asked for (or its file is bad)."""
    try:
        return Status(**json.loads((folder / STATUS).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def wait(folder: Path, proc: subprocess.Popen | None = None, report=None,
         poll_s: float = 0.5) -> Status:
    """Until the build of `folder` finishes (`proc`: the builder, when this process started
    it); `report(status)` hears its progress as it goes."""
    while True:
        status = read(folder) or Status("building")
        if status.finished:
            return status
        alive = proc.poll() is None if proc is not None else _alive(status.pid)
        if not alive:
            status = read(folder) or status  # it may have finished just now
            if status.finished:
                return status
            return Status("failed", error=f"the builder stopped before finishing "
                                          f"(its output: {folder / LOG})")
        if report is not None:
            report(status)
        time.sleep(poll_s)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _write(folder: Path, status: Status) -> None:
    text = json.dumps(dataclasses.asdict(status))
    atomic_write(folder / STATUS, lambda tmp: tmp.write_text(text))


# --- describing tensors ------------------------------------------------------------------


def describe(value):
    """A layer's weights or a step's arguments as JSON: tensors by shape, stride and dtype;
    named tuples (LayerWeights, Projection) by type and fields; low-bit weights with their
    kernel; tuples as lists; None as null."""
    if value is None:
        return None
    if isinstance(value, LowBitWeights):
        return {"kernel": value.kernel, "packed": describe(value.packed),
                "scales": describe(value.scales)}
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "stride": list(value.stride()),
                "dtype": str(value.dtype).removeprefix("torch.")}
    if hasattr(value, "_fields"):
        return {"type": type(value).__name__,
                "fields": {name: describe(getattr(value, name)) for name in value._fields}}
    if isinstance(value, tuple):
        return [describe(v) for v in value]
    raise TypeError(f"cannot describe a {type(value).__name__}")


def rebuild(desc):
    """What `describe` described, with zeros for every tensor (on the CPU)."""
    if desc is None:
        return None
    if isinstance(desc, list):
        return tuple(rebuild(d) for d in desc)
    if "kernel" in desc:
        return LowBitWeights(rebuild(desc["packed"]), rebuild(desc["scales"]), desc["kernel"])
    if "type" in desc:
        kind = {"LayerWeights": LayerWeights, "Projection": Projection,
                "StepInputs": StepInputs}[desc["type"]]
        return kind(**{name: rebuild(d) for name, d in desc["fields"].items()})
    tensor = torch.empty_strided(desc["shape"], desc["stride"], dtype=getattr(torch, desc["dtype"]))
    return tensor.zero_()


# --- the builder process -----------------------------------------------------------------


class Kind:
    """Layers whose weights have one layout (which tensors, their shapes and dtypes): one
    compiled package per step size serves them all. A GGUF file that stores some layers in
    other types (Q4_K_M's 6-bit ones) has a few kinds."""

    def __init__(self, weights: LayerWeights):
        leaves, self.structure = pytree.tree_flatten(weights)
        self.present = [i for i, t in enumerate(leaves) if t is not None]
        self.key = (str(self.structure),
                    tuple((tuple(t.shape), str(t.dtype)) for t in leaves if t is not None))
        self.example = weights  # the first layer of this kind (what packages are built on)

    def flat(self, weights: LayerWeights) -> list[torch.Tensor]:
        """A layer's tensors in the order its kind's packages take them (absent ones out)."""
        leaves = pytree.tree_flatten(weights)[0]
        return [leaves[i] for i in self.present]

    def unflatten(self, flat) -> LayerWeights:
        leaves = [None] * self.structure.num_leaves
        for i, tensor in zip(self.present, flat, strict=True):
            leaves[i] = tensor
        return pytree.tree_unflatten(leaves, self.structure)


# Operations whose result depends on the order of a reduction or on how a function is
# approximated (the norms' means, softmax, the MLP's activations, soft-capping) run ATen's
# own kernels inside a package, as the eager step runs them, instead of inductor's fused
# ones; the rest, fused, rounds to bf16 where eager rounds (emulate_precision_casts), and
# fp32 arithmetic is not contracted (inductor's default). With both steps padded to the
# same sizes the compiled step's logits are the eager step's, bit for bit.
EAGER_OPS = ("mean", "sum", "amax", "softmax", "_softmax", "exp", "sigmoid", "tanh", "silu",
             "gelu")


def eager_arithmetic() -> None:
    """Make inductor, in this process, run EAGER_OPS as ATen's kernels (the builder calls
    this once: it changes inductor's tables for the whole process)."""
    from torch._inductor import decomposition, lowering

    for name in EAGER_OPS:
        op = getattr(torch.ops.aten, name)
        for overload in op.overloads():
            decomposition.decompositions.pop(getattr(op, overload), None)
        lowering.make_fallback(op, warn=False, override_decomp=True)


def build_package(layer: Callable, kind: Kind, inputs: StepInputs, path: Path) -> None:
    """Export `layer` for layers of `kind` over a step's `inputs` (what SYMBOLIC names left
    symbolic) and compile it into the package at `path` (engine/lean/builder.py runs this,
    after `eager_arithmetic`). The package takes the StepInputs, then the layer's tensors."""
    from torch.export import Dim

    count = len(StepInputs._fields)

    class Layer(torch.nn.Module):
        def forward(self, *args):
            return layer(kind.unflatten(args[count:]), *args[:count])

    weights = kind.flat(kind.example)
    dims = {name: Dim(name, min=2) for name in ("window", "capacity")}
    symbolic = [None if at is None else {axis: dims[name] for axis, name in at.items()}
                for at in SYMBOLIC]
    shapes = ((*symbolic, *(None for _ in weights)),)  # forward's one *args
    with torch.inference_mode():
        program = torch.export.export(Layer(), (*inputs, *weights), dynamic_shapes=shapes,
                                      strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.stem}.{os.getpid()}.partial.pt2")
    # Inductor would precompile its headers into a global folder under /tmp (~280 MB a
    # compiler version, outside the cache folder it is given); measured here they did
    # not make building faster (52 s with, 53 s without, bundled model), so none are.
    with torch._inductor.config.patch({"aot_inductor.precompile_headers": False,
                                       "cpp_cache_precompile_headers": False,
                                       "emulate_precision_casts": True}):
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
    partial.replace(path)  # a package appears whole or not at all


def build(folder: Path, request: dict) -> Status:
    """Build every package `request` lists that `folder` lacks, saying how far it got."""
    from engine.lean.layer import make_layer
    from engine.lean.spec import LeanSpec
    from engine.weights import kernels

    use_inductor_cache()
    begin = time.perf_counter()
    spec = LeanSpec(**{**request["spec"], "windows": tuple(request["spec"]["windows"])})
    layer = make_layer(spec, request["wide_rows"])
    kinds = [Kind(rebuild(desc)) for desc in request["kinds"]]
    todo = [(size, kind, folder / name) for size, kind, name in request["packages"]
            if not (folder / name).is_file()]
    if any(isinstance(lin.weight, LowBitWeights) for k in kinds for lin in _linears(k.example)):
        kernels.available()  # Quickdraft's operators, which the low-bit layers call
    eager_arithmetic()
    _write(folder, Status("building", 0, len(todo), 0.0, pid=os.getpid()))
    for done, (size, kind, path) in enumerate(todo):
        build_package(layer, kinds[kind], rebuild(request["examples"][str(size)]), path)
        elapsed = time.perf_counter() - begin
        left = elapsed / (done + 1) * (len(todo) - done - 1)
        _write(folder, Status("building", done + 1, len(todo), elapsed, left, pid=os.getpid()))
    status = Status("done", len(todo), len(todo), time.perf_counter() - begin, 0.0,
                    pid=os.getpid())
    _write(folder, status)
    return status


def _linears(w) -> list:
    return [*w.qkv, w.o, *w.gate_up, w.down]


def main(argv: list[str] | None = None) -> int:
    folder = Path((argv or sys.argv[1:])[0])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with _locked(folder):  # a second builder of this folder waits, then finds it built
        try:
            request = json.loads((folder / REQUEST).read_text())
            status = build(folder, request)
        except Exception as exc:  # noqa: BLE001 - any failure is reported to the asker
            first = str(exc).splitlines()[0] if str(exc) else ""
            error = f"{type(exc).__name__}: {first}"[:300]
            log.exception("building the compiled step failed")
            _write(folder, Status("failed", error=error, pid=os.getpid()))
            return 1
    log.info("compiled step built in %.1f s (%d packages)", status.elapsed_s, status.total)
    return 0


@contextlib.contextmanager
def _locked(folder: Path):
    """An exclusive lock on the folder's lock file for the builder's lifetime (POSIX;
    elsewhere nothing: two builders then build the same packages twice, harmlessly)."""
    with open(folder / LOCK, "a") as file:
        if os.name == "posix":
            import fcntl

            fcntl.flock(file, fcntl.LOCK_EX)
        _write(folder, Status("building", pid=os.getpid()))
        yield


if __name__ == "__main__":
    sys.exit(main())
