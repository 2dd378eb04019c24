"""A GGUF file opened as it is stored (`--quant gguf`, what `auto` runs for a GGUF file):
its quantized tensors stay the file's own blocks (engine/weights/gguf_blocks.py), read once into the
kernels' repack (the file's size, never a float copy), the token table and the LM head
included; norms and biases become ordinary tensors.

The model around them is transformers' own, built empty from the file's settings, so the
lean step, the drafters and the trainer see the layers they always see. Only the settings
and the tokenizer are written to the user cache the first time (a few MB, reused on every
later start); tensor names and row orders come from transformers' GGUF mapping, as when
transformers itself reads the file.

A file that cannot be opened this way (another architecture or block type, no kernels, a
GPU) raises `NotStored`, and the loader converts it instead.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.paths import cache_dir
from engine.weights import gguf, gguf_blocks, gguf_header, kernels, pages, quant
from engine.weights.fingerprint import fingerprint
from engine.weights.gguf_blocks import BlockEmbedding, BlockLinear

log = logging.getLogger(__name__)

QUANT = "gguf"  # the --quant choice: the file's own blocks, as stored
LAYOUT = 1  # bumped when the prepared folder changes: folders of another layout are redone
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # GGUF architectures opened as stored
FLOATS = {0: "F32", 1: "F16", 30: "BF16"}  # GGML float types, kept as values
READ_BYTES = 1 << 24  # bytes read (and repacked) at a time: a bounded buffer
PROGRESS_S = 2.0  # seconds between progress lines while the weights are read


class NotStored(ModelLoadError):
    """This file cannot be opened as stored here (the loader converts it instead)."""


@dataclass
class Opened:
    model: nn.Module  # the causal LM, its layers on the file's blocks
    tokenizer: object
    fingerprint: str
    reason: str  # one line: what the file holds and how it runs


def open_stored(path: Path, device: torch.device,
                report: Callable[[str], None] | None = None) -> Opened:
    """The GGUF file at `path` as a model on its own blocks. NotStored where that cannot be
    done here; ModelLoadError (one line) for a damaged file."""
    report = report or (lambda _line: None)
    header = gguf_header.read(path)
    gguf.check_whole(header)
    if why := why_not(header, device):
        raise NotStored(why)
    folder = _prepared(path, header, report)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    from accelerate import init_empty_weights

    with init_empty_weights():  # parameters without memory; buffers (rotary tables) real
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    types = _place(model, header, config, report)
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise NotStored(f"{path.name}: {', '.join(empty[:3])} not found in the file")
    model.eval().requires_grad_(False)
    return Opened(model, tokenizer, fingerprint(model), _reason(types))


def why_not(header: gguf_header.Header, device: torch.device) -> str | None:
    """Why this file cannot run on its own blocks on `device` (None: it can)."""
    if header.architecture not in FAMILIES:
        return f"GGUF architecture {header.architecture!r} is not opened as stored"
    if device.type != "cpu":
        return "GGUF blocks run on the CPU's kernels"
    if not kernels.available():
        return f"the block kernels are not available here ({kernels.problem})"
    have = set(gguf_blocks.formats().values()) | set(FLOATS)
    odd = sorted({gguf.type_name(t.type) for t in header.tensors if t.type not in have})
    if odd:
        return f"no block kernel for its {', '.join(odd)} tensors"
    if all(t.type in FLOATS for t in header.tensors if len(t.shape) == 2):
        return "it holds no quantized blocks"
    return None


# --- settings and tokenizer, kept in the cache ----------------------------------------------


def _prepared(path: Path, header: gguf_header.Header, report) -> Path:
    """The cache folder with the file's transformers config and tokenizer: written the first
    time (the tokenizer is built from the file's vocabulary), read on every later start."""
    stem = "".join(c if c.isalnum() or c in "._-" else "-" for c in path.name)[:60]
    folder = cache_dir() / "models" / "gguf" / f"{stem}-{gguf.file_key(path)}-stored{LAYOUT}"
    if (folder / "tokenizer_config.json").is_file():  # the folder appears whole or not at all
        return folder
    report(f"reading {path.name}'s settings and tokenizer (first time only)")
    from transformers import AutoConfig, TokenizersBackend

    if "tokenizer.ggml.model" not in header.fields:
        raise ModelLoadError(f"{path} has no tokenizer in its GGUF metadata")
    try:
        config = AutoConfig.for_model(**config_dict(header))
        tokenizer = TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"{path}: its settings or tokenizer cannot be read: "
                             f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                             ) from exc
    def write(tmp: Path) -> None:
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    gguf.write_folder(folder, write, "tokenizer_config.json")
    return folder


def config_dict(header: gguf_header.Header) -> dict:
    """The transformers config of the file, as transformers' own GGUF reader derives it for
    these architectures (its name mapping, defaults and tied-head rule), from the header."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    fields, arch = header.fields, header.architecture
    names = {t.name for t in header.tensors}
    updated = "mistral" if "llama" in arch and fields.get("general.name") == "mistral" else arch
    config = {"tie_word_embeddings": "output.weight" not in names}
    for key, value in (GGUF_CONFIG_DEFAULTS_MAPPING.get(updated)
                       or GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    for key, value in fields.items():
        prefix, _, rest = key.replace(arch, updated).partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is None or renamed == -1:
            continue
        config[renamed] = value.replace(arch, updated) if isinstance(value, str) else value
    config.setdefault("vocab_size", fields.get("tokenizer.ggml.tokens"))
    return config


# --- the tensors ----------------------------------------------------------------------------


def _place(model: nn.Module, header: gguf_header.Header, config, report) -> dict[str, str]:
    """Put every tensor of the file into `model` (linear layers as BlockLinear, the token
    table as a BlockEmbedding); returns {module name: GGML type name} of the block layers."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config.to_dict())
    names = _names(model, header.architecture, config.num_hidden_layers)
    reader = _Reader(header, report)
    values, blocks = {}, {}
    for tensor in sorted(header.tensors, key=lambda t: t.start):  # one pass through the file
        if tensor.type in FLOATS or len(tensor.shape) == 1:
            found = processor.process(reader.values(tensor), tensor.name,
                                      tensor_key_mapping=names, parsed_parameters={})
            if found.name in names:
                values[names[found.name]] = torch.from_numpy(np.copy(found.weights))
        else:
            order, name = _row_order(processor, names, tensor)
            if name in names:
                blocks[names[name]] = (tensor, reader.rows(tensor, order))
    reader.done()
    return _assemble(model, values, blocks)


def _names(model: nn.Module, arch: str, layers: int) -> dict[str, str]:
    """{GGUF tensor name: the model's parameter name}, by gguf's own name table, as
    transformers maps them (its `get_gguf_hf_weights_map` builds that table once per module,
    ~20 s for a 30-layer model; once is enough for these architectures)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    table = get_tensor_name_map(arch_id, layers)
    names = {}
    for key in model.state_dict():
        base, _, suffix = key.rpartition(".")
        found = table.get_name(base)
        if found is not None:
            names[f"{found}.{suffix}"] = key
    return names


def _row_order(processor, names: dict, tensor: gguf_header.Tensor
               ) -> tuple[torch.Tensor | None, str]:
    """(the file's row for each of the model's rows, or None when they are in order; the
    tensor's name after the processor): transformers' processor applied to a probe of row
    numbers. Refused (NotStored) where it does more than reorder rows."""
    rows = tensor.shape[0]
    index = np.arange(rows, dtype=np.float32)
    probe = np.stack([index, 2 * index + 1], axis=1)
    found = processor.process(probe, tensor.name, tensor_key_mapping=names,
                              parsed_parameters={})
    got = np.asarray(found.weights)
    if got.shape != probe.shape or not np.array_equal(got[:, 1], 2 * got[:, 0] + 1) or \
            not np.array_equal(np.sort(got[:, 0]), index):
        raise NotStored(f"{tensor.name}'s values are changed on loading, not only reordered")
    order = torch.from_numpy(got[:, 0].astype(np.int64))
    return (None if torch.equal(order, torch.arange(rows)) else order), found.name


class _Reader:
    """Reads the file's tensors in bounded pieces, repacking block rows as they come, and
    reports progress every few seconds."""

    def __init__(self, header: gguf_header.Header, report):
        self.header, self.report = header, report
        self.file = open(header.path, "rb")  # noqa: SIM115 - closed by done()
        self.total = sum(gguf.tensor_bytes(t) for t in header.tensors)
        self.read, self.start = 0, time.perf_counter()
        self.said = self.start

    def _read(self, tensor: gguf_header.Tensor, offset: int, size: int) -> np.ndarray:
        self.file.seek(tensor.start + offset)
        data = np.empty(size, np.uint8)
        if self.file.readinto(data) != size:
            raise ModelLoadError(f"{self.header.path} is truncated: download it again")
        self.read += size
        now = time.perf_counter()
        if now - self.said > PROGRESS_S:
            self.said = now
            self.report(f"reading {self.header.path.name}: {self.read / self.total:.0%} of "
                        f"{self.total / 1e6:,.0f} MB")
        return data

    def values(self, tensor: gguf_header.Tensor) -> np.ndarray:
        """A float tensor's values (float32, in its shape)."""
        from gguf import GGMLQuantizationType, quants

        raw = self._read(tensor, 0, gguf.tensor_bytes(tensor))
        return quants.dequantize(raw, GGMLQuantizationType(tensor.type)).reshape(tensor.shape)

    def rows(self, tensor: gguf_header.Tensor, order: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """A block tensor repacked for the kernels: ((N rounded up to whole groups, bytes per
        row) uint8, row r being the file's row order[r]; its (type, rows per group))."""
        rows, row_bytes = tensor.shape[0], gguf.tensor_bytes(tensor) // tensor.shape[0]
        group = quant.group_rows(rows)
        step = rows if order is not None else max(1, READ_BYTES // row_bytes // group) * group
        packed = pages.weight_buffer(((rows + group - 1) // group * group, row_bytes))
        for first in range(0, rows, step):
            count = min(step, rows - first)
            raw = torch.from_numpy(self._read(tensor, first * row_bytes, count * row_bytes))
            raw = raw.view(count, row_bytes)
            if order is not None:
                raw = raw[order]
            part = torch.ops.quickdraft.block_repack(raw, tensor.type, group)
            packed[first:first + part.shape[0]] = part
        return packed, torch.tensor([tensor.type, group])

    def done(self) -> None:
        self.file.close()
        seconds = time.perf_counter() - self.start
        if seconds > PROGRESS_S:
            self.report(f"read {self.total / 1e6:,.0f} MB of blocks in {seconds:.0f} s")


def _assemble(model: nn.Module, values: dict, blocks: dict) -> dict[str, str]:
    """Put the file's tensors into the empty `model`; {module: type name} of block layers."""
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    table_key = _embedding_key(model)
    tied = f"{head_name}.weight" not in blocks and f"{head_name}.weight" not in values
    types = {}
    for key, (tensor, (packed, meta)) in blocks.items():
        module_name = key.removesuffix(".weight")
        layer = BlockLinear(packed, meta, gguf.type_name(tensor.type), tensor.shape[0],
                            tensor.shape[1], values.pop(f"{module_name}.bias", None))
        types[module_name] = layer.kind
        if key != table_key:
            _set_module(model, module_name, layer)
            continue
        if tied:  # one table: the head multiplies by it, the embedding looks rows up in it
            _set_module(model, head_name, layer)
        model.set_input_embeddings(BlockEmbedding(layer, tied))
    for key, value in values.items():
        module_name, _, attr = key.rpartition(".")
        setattr(model.get_submodule(module_name), attr,
                nn.Parameter(value.to(torch.bfloat16), requires_grad=False))
    if tied and table_key in values:  # a float table: the head shares it
        model.get_submodule(head_name).weight = model.get_input_embeddings().weight
    return types


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _embedding_key(model: nn.Module) -> str:
    table = model.get_input_embeddings()
    return next(f"{n}.weight" for n, m in model.named_modules() if m is table)


def _reason(types: dict[str, str]) -> str:
    counts = Counter(types.values())
    held = ", ".join(f"{kind} for {n} layer{'s' * (n > 1)}" for kind, n in sorted(counts.items()))
    return f"the GGUF file's own blocks, as stored ({held})"
