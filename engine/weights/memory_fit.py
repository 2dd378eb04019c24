"""What a model needs in memory, read before any weight is loaded, and what `--quant auto`
chooses on a GPU: the checkpoint's own parameters (from its safetensors headers, whatever
dtype they are stored in), each choice's bytes per parameter, the KV cache of the context
planned for, and the card's free memory now. The largest choice that fits wins: the card's
half precision (bf16, or fp16 where it has no native bf16), else 4 bits (PyTorch's int4
kernel from compute capability 8.0, bitsandbytes' NF4 before). Where nothing fits on the GPU
the model runs on the CPU (when the device was left to auto). Every choice says why in one
line, and an out-of-memory error while loading becomes one line naming what was needed and
a choice that fits (`oom_line`).
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import devices
from engine.devices import Card
from engine.errors import ModelLoadError

# Bytes per parameter of a layer's matrix in each choice: int4 packs two codes per byte
# with a 16-bit scale and zero per group of 32; NF4 two per byte with double-quantized block
# scales; the 8-bit choices a byte and a scale per row.
MATRIX_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8w": 1.0, "int4": 0.625,
                "nf4": 0.53, "int8": 1.0}
# The LM head's: int4 keeps it in 8 bits (engine/weights/quant.HEAD_KIND); bitsandbytes leaves it in
# 16 bits. A tied token table is the head's (int4/int8w read it from the head's codes).
HEAD_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8w": 1.0, "int4": 1.0, "nf4": 2.0,
              "int8": 2.0}
PLANNED_CONTEXT = 8192  # KV cache planned for (the cache grows as a chat needs it)
PREFILL_ROWS = 512  # prompt tokens per pass (engine/lean/lean_target.PREFILL_CHUNK)
RESERVE_BYTES = 512 * 2**20  # the allocator's slack, CUDA graphs' pools, logits, a drafter
# Tensor names of token tables (not quantized unless tied to the LM head)
TABLE_NAMES = ("embed", "wte", "wpe", "word_embeddings")


@dataclass(frozen=True)
class Checkpoint:
    """A model folder's shapes, read from its safetensors headers and config.json."""

    matrices: int  # parameters of the layers' 2-D weights (what low-bit choices pack)
    head: int  # parameters of the LM head (0: tied to the token table, stored once)
    tables: int  # parameters of token tables (16-bit under low-bit choices unless tied)
    others: int  # parameters of 1-D tensors: norms, biases
    stored_bytes: int  # the files' tensor bytes
    dtype: str  # the dtype most parameters are stored in: "BF16", "F16", "F32", ...
    layers: int  # decoder layers
    kv_width: int  # key (= value) features per token and layer: kv heads x head size
    heads: int  # attention heads (the prompt pass's scores are heads x rows x positions)
    context: int  # positions the model supports

    @property
    def parameters(self) -> int:
        return self.matrices + self.head + self.tables + self.others


def read_checkpoint(folder: Path) -> Checkpoint:
    """The checkpoint in `folder` (safetensors files and config.json), no weight read."""
    counts: Counter[str] = Counter()
    matrices = head = tables = others = stored = 0
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            n = math.prod(entry["shape"])
            counts[entry["dtype"]] += n
            start, end = entry["data_offsets"]
            stored += end - start
            if len(entry["shape"]) < 2:
                others += n
            elif name.startswith("lm_head."):
                head += n
            elif any(t in name for t in TABLE_NAMES):
                tables += n
            else:
                matrices += n
    config = _text_config(folder)
    heads = int(config.get("num_attention_heads") or 0)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (config.get("hidden_size", 0) // max(heads, 1)))
    return Checkpoint(matrices, head, tables, others, stored,
                      counts.most_common(1)[0][0] if counts else "F32",
                      int(config.get("num_hidden_layers") or 0), kv_heads * head_dim, heads,
                      int(config.get("max_position_embeddings") or 2048))


def _text_config(folder: Path) -> dict:
    """config.json's language model part (a vision-language model nests it)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config.get("text_config") or config


def weights_bytes(ck: Checkpoint, quant: str) -> int:
    """Bytes of the weights in `quant`: the layers' matrices and the LM head as that choice
    stores them, an untied token table and the norms in 16 bits (fp32 in fp32)."""
    rest = 4.0 if quant == "fp32" else 2.0
    if ck.head:
        head, table = ck.head * HEAD_BYTES[quant], ck.tables * rest
    else:  # tied: one table, stored as the head
        head, table = ck.tables * HEAD_BYTES[quant], 0
    return int(ck.matrices * MATRIX_BYTES[quant] + head + table + ck.others * rest)


def runtime_bytes(ck: Checkpoint, tokens: int, element_bytes: int = 2) -> int:
    """What decoding `tokens` positions adds to the weights: the KV cache, a prompt pass's
    attention scores (fp32, and their softmax in half precision: engine/lean/layer.py) and
    a fixed reserve."""
    cache = 2 * ck.layers * ck.kv_width * tokens * element_bytes
    scores = ck.heads * PREFILL_ROWS * tokens * (4 + element_bytes)
    return cache + scores + RESERVE_BYTES


@dataclass(frozen=True)
class Fit:
    """Where a model runs and in which weights, with why, and what each choice needs."""

    quant: str  # the resolved --quant choice
    device: torch.device  # where it runs (may differ from the device first picked)
    reason: str  # one line: what was chosen and why ("" for an explicit choice that runs)
    needs: dict[str, int] = field(default_factory=dict)  # bytes each choice needs there
    free: int = 0  # bytes free on that device when planned
    moved: str = ""  # why the model left the device first picked ("" when it did not)

    def smaller(self) -> str | None:
        """The best choice in `needs` that takes less than this one and fits in `free` (what
        an out-of-memory error suggests), if any."""
        own = self.needs.get(self.quant, 2**62)
        return next((q for q, n in self.needs.items() if n < own and n <= self.free), None)


def ladder(card: Card) -> list[str]:
    """Auto's choices, best first. On a CUDA card its half precision, then 4 bits (PyTorch's
    int4 kernel needs compute capability 8.0; bitsandbytes' NF4 before it); Apple's GPU
    runs the unquantized ones only; on a CPU (what an out-of-memory line suggests there)
    bf16, 8 and 4 bits on Quickdraft's kernels."""
    if card.kind == "mps":
        return [card.half]
    if card.kind == "cpu":
        return ["bf16", "int8w", "int4"]
    return [card.half, "int4" if card.tinygemm else "nf4"]


def needs(ck: Checkpoint, choices: list[str]) -> dict[str, int]:
    """Bytes each of `choices` needs for a chat of up to PLANNED_CONTEXT tokens."""
    tokens = min(ck.context or PLANNED_CONTEXT, PLANNED_CONTEXT)
    extra = runtime_bytes(ck, tokens)
    return {q: weights_bytes(ck, q) + extra for q in choices}


def plan(requested: str, requested_device: str, device: torch.device,
         ck: Checkpoint, card: Card | None = None) -> Fit:
    """Resolve `requested` (a --quant choice, maybe "auto") for a model `ck` on `device`,
    the device picked for `requested_device`. `card`: `device`'s capabilities (read from
    torch when None)."""
    card = devices.card(device) if card is None else card
    choices = ladder(card)
    table = needs(ck, list(dict.fromkeys([*choices, requested] if requested in MATRIX_BYTES
                                         else choices)))
    if device.type == "cpu":
        # On a CPU, bf16 is where Auto starts: engine/weights/quant_auto.py measures fp32, bf16 and
        # the low-bit choices on the model's own answers and speed, and keeps one.
        return Fit("bf16" if requested == "auto" else requested, device, "", table,
                   card.free_bytes)
    if requested != "auto":
        return _explicit(requested, requested_device, device, card, table)
    chosen = next((q for q in choices if table[q] <= card.free_bytes), None)
    if chosen is not None:
        return Fit(chosen, device, _why(chosen, ck, card, table), table, card.free_bytes)
    smallest = choices[-1]
    short = (f"even {smallest} needs {gb(table[smallest])}, {gb(card.free_bytes)} free on "
             f"{card.name}")
    if requested_device == "auto":  # sized for the CPU, so running out there says what fits
        cpu = devices.card(torch.device("cpu"))
        return Fit("bf16", torch.device("cpu"), "", needs(ck, ladder(cpu)), cpu.free_bytes,
                   moved=f"it does not fit on the GPU ({short})")
    return Fit(smallest, device, f"{smallest}, though it does not fit: {short}", table,
               card.free_bytes)


def _explicit(requested: str, requested_device: str, device: torch.device, card: Card,
              table: dict[str, int]) -> Fit:
    """An explicit choice on a GPU: kept where it runs; int4 on a card before compute
    capability 8.0 runs as NF4; on Apple's GPU, a choice that does not run there moves
    the model to the CPU (or is refused where that device was asked for)."""
    if card.kind == "mps" and (requested not in devices.MPS_QUANTS
                               or (requested == "bf16" and not card.bf16)):
        why = ("bf16 needs macOS 14 on Apple's GPU" if requested == "bf16"
               else f"{requested} has no kernels for Apple's GPU")
        if requested_device == "mps":
            raise ModelLoadError(f"{why}: choose {', '.join(devices.MPS_QUANTS)} on mps")
        return Fit(requested, torch.device("cpu"), "", moved=why)
    if requested == "int4" and card.kind == "cuda" and not card.tinygemm:
        major, minor = card.capability
        return Fit("nf4", device, f"nf4: int4 runs on PyTorch's tinygemm kernel, which needs "
                   f"compute capability 8.0 (this card has {major}.{minor}); bitsandbytes' "
                   "NF4 is the 4-bit choice here", table, card.free_bytes)
    return Fit(requested, device, "", table, card.free_bytes)


def _why(chosen: str, ck: Checkpoint, card: Card, table: dict[str, int]) -> str:
    stored = f"{ck.parameters / 1e9:.2f} B parameters stored in {ck.dtype.lower()}"
    tokens = min(ck.context or PLANNED_CONTEXT, PLANNED_CONTEXT)
    parts = [f"{q} needs {gb(n)}" for q, n in table.items()]
    line = (f"{chosen}: {stored}; with a KV cache for {tokens:,} tokens "
            f"{', '.join(parts)}; {gb(card.free_bytes)} free on {card.name}")
    if chosen == "fp16" and card.kind == "cuda":
        major, minor = card.capability
        line += f" (no native bf16 before compute capability 8.0; this card has {major}.{minor})"
    return line


def gb(n: float) -> str:
    return f"{n / 2**30:.1f} GB"


def oom_line(model: str, fit: Fit, where: str) -> str:
    """One line for an out-of-memory error while loading `model` as `fit` planned: what it
    needed, what was free, and a choice that fits (or the CPU)."""
    need = fit.needs.get(fit.quant)
    needed = f"about {gb(need)} needed, " if need else ""
    line = (f"not enough memory on {where} for {model} in {fit.quant} "
            f"({needed}{gb(fit.free)} free when loading began)")
    smaller = fit.smaller()
    if smaller is not None:
        return f"{line}: --quant {smaller} needs about {gb(fit.needs[smaller])}"
    if fit.device.type == "cpu":
        return f"{line}: close other programs, or choose a smaller model"
    return f"{line}: try --device cpu, or a smaller model"


def is_oom(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed: CUDA's and Apple's out-of-memory
    errors, or the CPU allocator's."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text
                                                or "out of memory" in text.lower())


@contextlib.contextmanager
def readable_oom(model: str, fit: Fit, where: str):
    """Turn running out of memory anywhere inside into one ModelLoadError line (oom_line),
    the memory the failed attempt held handed back first."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_oom(error):
            raise
        line = oom_line(Path(model).name or model, fit, where)
        error.__traceback__ = None  # the frames hold the tensors that did not fit
        if fit.device.type == "cuda":
            torch.cuda.empty_cache()
        raise ModelLoadError(line) from None
