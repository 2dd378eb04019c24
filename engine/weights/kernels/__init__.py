"""Quickdraft's own CPU kernels (blocks.cpp: low-bit weights in blocks, formats.h: GGUF
files' own formats and Quickdraft's int4 and int8w; attention.cpp: decode attention of many
sequences at once), compiled on first use with the C++ compiler that torch.compile already
needs, and registered as torch operators (`quickdraft::...`), so eager code, torch.export
and AOTInductor packages call them like any other operator.

The library is built once per machine into the user cache, under a key of its sources,
torch and the compiler flags (VNNI's and AVX-512's where the CPU has them); a later start
loads it in milliseconds. Where it cannot be built or loaded (no compiler, no AVX2, a failed build)
`available()` is False and the callers keep PyTorch's own kernels; the reason is logged
once and kept in `problem`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from engine import devices
from engine.paths import cache_dir

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "blocks.cpp", HERE / "attention.cpp")  # compiled into one library
HEADERS = (HERE / "activations.h", HERE / "lanes.h", HERE / "formats.h")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17", "-w", "-shared", "-fPIC")
BUILD_SECONDS = 300  # a build that takes longer is abandoned (the kernels stay PyTorch's)

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
problem = ""  # why the kernels are not available, once that is known


def available() -> bool:
    """Whether `torch.ops.quickdraft` is there (building and loading it on first call)."""
    global _loaded, problem
    with _lock:
        if _loaded is None:
            try:
                # A second library registering the same operators would abort the process.
                if not _registered():
                    torch.ops.load_library(str(_library()))
                _loaded = True
            except Exception as exc:  # noqa: BLE001 - any failure keeps PyTorch's kernels
                problem = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                log.warning("Quickdraft's CPU kernels are not available (%s): "
                            "using PyTorch's", problem)
                _loaded = False
        return _loaded


def _registered() -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("quickdraft::block_linear", "CPU")
    except RuntimeError:  # no such operator yet
        return False


def _cpu_flags() -> set[str]:
    return devices.cpu_flags()


def vnni_flags() -> tuple[str, ...]:
    """Compiler flags for the CPU's VNNI dot product, where it has one (the kernels then
    use it; the library's key includes the flags)."""
    cpu = _cpu_flags()
    if "avx_vnni" in cpu:
        return ("-mavxvnni",)
    if {"avx512_vnni", "avx512_vl"} <= cpu:
        return ("-mavx512vnni", "-mavx512vl")
    return ()


def wide_flags() -> tuple[str, ...]:
    """Compiler flags for the block kernels' 512-bit form (16 outputs per register, lanes.h),
    where the CPU has AVX-512 with VNNI."""
    if {"avx512_f", "avx512_bw", "avx512_vl", "avx512_vnni"} <= _cpu_flags():
        return ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-DQUICKDRAFT_WIDE")
    return ()


def needs_building() -> bool:
    """Whether the first use will compile the library (about half a minute): not loaded
    yet, and not in the cache for this machine."""
    if _loaded is not None:
        return False
    try:
        return not _command_and_path()[1].is_file()
    except RuntimeError:  # no AVX2 or no compiler: nothing will be built
        return False


def _command_and_path() -> tuple[list[str], Path]:
    """The compiler command for this source, torch and machine, and the library it makes."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise RuntimeError("this CPU has no AVX2")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (install g++)")
    includes, links = _torch_flags()
    flags = dict.fromkeys([*vnni_flags(), *wide_flags()])  # in order, once each
    command = [compiler, *FLAGS, *flags, *includes, *map(str, SOURCES),
               *links]  # libraries after the sources
    text = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    machine = devices.machine().build_key.encode()
    key = hashlib.sha256(text + repr(command).encode() + machine).hexdigest()[:16]
    return command, cache_dir() / "kernels" / key / "quickdraft_lowbit.so"


def _library() -> Path:
    """The built library for this source, torch and machine: from the cache, else built."""
    command, path = _command_and_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: a library appears whole or not at all.
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        done = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True,
                              timeout=BUILD_SECONDS)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {', '.join(p.name for p in SOURCES)} failed: "
                               f"{(done.stderr or done.stdout).strip()[-300:]}")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _torch_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) for building against this torch."""
    from torch.utils import cpp_extension

    lib = cpp_extension.library_paths()[0]
    includes = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                *(f"-I{p}" for p in cpp_extension.include_paths())]
    return includes, [f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]
