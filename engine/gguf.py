"""GGUF files (LM Studio, Ollama, llama.cpp downloads): check them, and convert them once into
a folder in the user cache. A file of float weights becomes a safetensors model folder; a
quantized one keeps its bits (engine/lowbit_folder.py): its linear layers are stored as
4- or 8-bit codes and load into the low-bit kernels.

transformers reads and dequantizes GGUF for the architectures it knows (names, layouts);
the converted folder reloads in about a second, where reading the GGUF again would take
seconds to minutes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from engine import lowbit_folder
from engine.errors import ModelLoadError
from engine.fingerprint import fingerprint
from engine.paths import cache_dir

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # the GGUF versions the gguf reader understands
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
    # transformers has no public list; tests/engine/gguf/test_gguf.py names this import so an
    # upgrade that moves it fails there first.
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


def is_gguf(path: Path) -> bool:
    """True when the file starts with the GGUF magic (Ollama blobs have no extension)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def inspect(path: Path) -> GGUFInfo:
    """Read and check a GGUF header; ModelLoadError names the file and what is supported."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    if not is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF header); give a .gguf file, "
                             "a model folder or a repo id")
    _check_version(path)
    reader = _reader(path)
    _check_strings(path, reader)
    size = path.stat().st_size
    if not reader.tensors:
        raise ModelLoadError(f"{path} holds no tensors: it is not a model, or it is corrupt")
    end = max(t.data_offset + int(t.n_bytes) for t in reader.tensors)
    if end > size:
        raise ModelLoadError(f"{path} is truncated ({size:,} of {end:,} bytes): download it again")
    arch = _field(reader, "general.architecture") or "?"
    if arch not in supported_architectures():
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(supported_architectures())}")
    types = tuple(sorted({t.tensor_type.name for t in reader.tensors}))
    unknown = [t for t in types if t not in supported_types()]
    if unknown:
        raise ModelLoadError(f"{path}: GGUF tensor type {', '.join(unknown)} is not supported; "
                             f"supported: {', '.join(supported_types())}")
    if _field(reader, "tokenizer.ggml.model") is None:
        raise ModelLoadError(f"{path} has no tokenizer in its GGUF metadata")
    return GGUFInfo(path, arch, _field(reader, "general.name") or path.name,
                    sum(int(t.n_elements) for t in reader.tensors), size, types)


def _check_version(path: Path) -> None:
    with open(path, "rb") as f:
        version = int.from_bytes(f.read(8)[4:], "little")
    if version not in VERSIONS:
        raise ModelLoadError(f"{path}: unsupported GGUF version {version} (supported: "
                             f"{', '.join(map(str, VERSIONS))})")


def _check_strings(path: Path, reader) -> None:
    """gguf cuts a string that claims more bytes than the file holds; say so instead."""
    from gguf import GGUFValueType

    for field in reader.fields.values():
        if len(field.parts) == 5 and field.types == [GGUFValueType.STRING]:
            claimed, held = int(field.parts[3][0]), len(field.parts[4])
            if claimed != held:
                raise ModelLoadError(f"{path}: the value of {field.name!r} is too long for "
                                     f"the file ({claimed:,} bytes claimed, {held:,} held): "
                                     "the file is corrupt or truncated")


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except IndexError as exc:  # a length in the header points past the end of the file
        raise ModelLoadError(f"{path} is corrupt: a header entry is too long for the file "
                             "(or the file is truncated): download it again") from exc
    except (ValueError, KeyError, OSError, OverflowError, TypeError) as exc:
        # gguf reads the header through a memory map: a cut file fails wherever it ends
        raise ModelLoadError(f"{path} is truncated or corrupt ({type(exc).__name__}): "
                             "download it again") from exc


def _field(reader, key: str):
    """A string or number field of the header, or None."""
    field = reader.get_field(key)
    if field is None:
        return None
    try:
        return field.contents()
    except (ValueError, IndexError, TypeError):
        return None


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
    """The safetensors folder for a GGUF file: converted on first use, reused after."""
    report = report or (lambda _message: None)
    stem = re.sub(r"[^\w.-]+", "-", path.name.removesuffix(".gguf"))[:60] or "model"
    key = file_key(path)
    # "-lb<format>": folders written before low-bit folders existed are not reused
    target = cache_dir() / "models" / "gguf" / f"{stem}-{key}-lb{lowbit_folder.FORMAT}"
    if (target / "config.json").is_file():  # the folder appears whole or not at all
        return target
    info = inspect(path)
    report(f"converting {path.name} ({info.file_bytes / 1e6:,.0f} MB, {info.architecture}, "
           f"{'/'.join(info.tensor_types)}) to safetensors: first time only")
    start = time.perf_counter()
    convert(path, target)
    report(f"converted {path.name} in {time.perf_counter() - start:.0f} s")
    shutil.rmtree(target.with_name(f"{stem}-{key}"), ignore_errors=True)  # fp32 expansion
    return target


def convert(path: Path, target: Path, keep_bits: bool = True) -> None:
    """Read the GGUF once and save its folder, atomically: quantized linear layers as codes
    when `keep_bits` (see engine/lowbit_folder.py), everything else as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (first use only)", path.name)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
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
    tensors = _hf_tensors(path, model) if keep_bits else {}
    kinds = lowbit_folder.layer_kinds(model, tensors)
    if kinds:
        lowbit_folder.save(model, kinds, tensors, tmp, fingerprint(model))
        model.config.save_pretrained(tmp)
    else:
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(target)  # atomic: a concurrent or interrupted conversion leaves no half folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
        if not (target / "config.json").is_file():
            raise


def _hf_tensors(path: Path, model) -> dict:
    """{transformers parameter name: the file's tensor} ({} where transformers
    cannot map this architecture's names: the folder is then written dense)."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    try:
        names = get_gguf_hf_weights_map(model, TensorProcessor())
    except (KeyError, ValueError, NotImplementedError) as exc:
        log.info("GGUF names of %s not mapped (%s): its weights are expanded", path.name, exc)
        return {}
    return {names[t.name]: t for t in _reader(path).tensors if t.name in names}
