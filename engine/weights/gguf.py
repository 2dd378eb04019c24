"""GGUF files (LM Studio, Ollama, llama.cpp downloads): check them, and, where a file cannot
run on its own blocks (engine/weights/gguf_model.py: another architecture or block type, a GPU, or
a choice that expands it), convert it once into a safetensors folder in the user cache.

transformers reads and dequantizes GGUF for the architectures it knows (names, layouts);
the converted folder reloads in about a second, where reading the GGUF again would take
seconds to minutes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError
from engine.paths import cache_dir
from engine.weights import gguf_header

log = logging.getLogger(__name__)

# Bytes hashed from the start, middle and end of a file to name its converted folder: cheap
# on multi-GB files, and a re-downloaded or edited file (other header, other weights) misses.
SAMPLE_BYTES = 1 << 20
# What a GGUF repo id looks like: "owner/name:file.gguf" (the file may sit in a sub-folder).
HUB_GGUF = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+):(?P<file>[^:]+)$")


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file holds, read from its header (no weights are read)."""

    path: Path
    architecture: str  # general.architecture, e.g. "llama", "qwen2"
    name: str  # general.name when set, else the file name
    parameters: int  # elements in all tensors
    file_bytes: int
    tensor_types: tuple[str, ...]  # GGML types used, e.g. ("F32", "Q4_K", "Q6_K")


def supported_architectures() -> list[str]:
    # transformers has no public list; tests/engine/weights/gguf/test_gguf.py names this
    # import so an upgrade that moves it fails there first.
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # "general" and "tokenizer" are metadata sections of the mapping, not architectures.
    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def supported_types() -> list[str]:
    """The GGML types gguf's numpy dequantizer implements (its public per-type classes)."""
    from gguf import quants

    found = (getattr(quants, n) for n in dir(quants) if not n.startswith("_"))
    return ["F32", "F16", *sorted(c.qtype.name for c in found if isinstance(c, type)
                                  and isinstance(getattr(c, "qtype", None),
                                                 quants.GGMLQuantizationType))]


def inspect(path: Path) -> GGUFInfo:
    """Read and check a GGUF header; ModelLoadError names the file and what is supported."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    header = gguf_header.read(path)
    if not header.tensors:
        raise ModelLoadError(f"{path} holds no tensors: it is not a model, or it is corrupt")
    arch = header.architecture
    if arch not in supported_architectures():
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(supported_architectures())}")
    types = tuple(sorted({type_name(t.type) for t in header.tensors}))
    unknown = [t for t in types if t not in supported_types()]
    if unknown:
        raise ModelLoadError(f"{path}: GGUF tensor type {', '.join(unknown)} is not supported; "
                             f"supported: {', '.join(supported_types())}")
    check_whole(header)
    if "tokenizer.ggml.model" not in header.fields:
        raise ModelLoadError(f"{path} has no tokenizer in its GGUF metadata")
    name = header.fields.get("general.name")
    return GGUFInfo(path, arch, name if isinstance(name, str) and name else path.name,
                    sum(math.prod(t.shape) for t in header.tensors), header.size, types)


def check_whole(header: gguf_header.Header) -> None:
    """ModelLoadError for a file shorter than its tensor table says it is."""
    end = max((t.start + tensor_bytes(t) for t in header.tensors), default=0)
    if end > header.size:
        raise ModelLoadError(f"{header.path} is truncated ({header.size:,} of {end:,} bytes): "
                             "download it again")


def type_name(kind: int) -> str:
    """A GGML type id's name ("Q4_K")."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


def tensor_bytes(tensor: gguf_header.Tensor) -> int:
    """The bytes `tensor` takes in the file (0 for a type gguf does not know)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        elems, size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.type)]
    except (ValueError, KeyError):
        return 0
    return math.prod(tensor.shape) // elems * size


def parse_hub(source: str) -> tuple[str, str] | None:
    """"owner/name:file.gguf" -> (repo id, file name); None for anything else."""
    match = HUB_GGUF.match(source)
    if match is None or source.startswith((".", "/", "~", "\\")):
        return None
    return match["repo"], match["file"]


def hub_file(repo_id: str, filename: str, revision: str | None = None) -> Path:
    """The GGUF file from the Hugging Face cache, downloaded there first if needed."""
    from engine import hub

    return hub.fetch(repo_id, filename, revision)


def file_key(path: Path) -> str:
    """Short hash of a file's size, modification time and three samples of its bytes (see
    SAMPLE_BYTES): the time catches an edit between the samples (same size, other weights)."""
    stat = path.stat()
    size = stat.st_size
    digest = hashlib.sha256(f"{size} {stat.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        for offset in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:12]


def converted_folder(path: Path, report=None) -> Path:
    """The safetensors folder for a GGUF file (its weights expanded to fp32): converted on
    first use, reused after."""
    report = report or (lambda _message: None)
    stem = re.sub(r"[^\w.-]+", "-", path.name.removesuffix(".gguf"))[:60] or "model"
    target = cache_dir() / "models" / "gguf" / f"{stem}-{file_key(path)}"
    if (target / "config.json").is_file():  # the folder appears whole or not at all
        return target
    info = inspect(path)
    report(f"converting {path.name} ({info.file_bytes / 1e6:,.0f} MB, {info.architecture}, "
           f"{'/'.join(info.tensor_types)}) to safetensors: first time only")
    start = time.perf_counter()
    convert(path, target)
    report(f"converted {path.name} in {time.perf_counter() - start:.0f} s")
    return target


def convert(path: Path, target: Path) -> None:
    """Read the GGUF once through transformers and save its folder (fp32 safetensors and the
    tokenizer), atomically."""
    log.info("converting %s to safetensors (first use only)", path.name)
    write_folder(target, lambda tmp: _convert_into(path, tmp), "config.json")


def write_folder(target: Path, write: Callable[[Path], object], marker: str) -> None:
    """`target` filled by `write(a temporary folder)`, renamed into place: a concurrent or
    interrupted writer leaves no half folder; where another got there first (its `marker`
    file is there), its folder stays."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # its own folder: two writers at once (the load and a page event) must not share one
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        write(tmp)
        tmp.rename(target)
    except OSError:
        if not (target / marker).is_file():  # else another writer won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_into(path: Path, tmp: Path) -> None:
    """The GGUF's model (fp32) and tokenizer saved into the folder `tmp`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError, OSError) as exc:
        raise ModelLoadError(f"{path}: transformers cannot convert this GGUF: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                             ) from exc
    # The weights are plain fp32 now; without this the saved config would claim GGUF.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
