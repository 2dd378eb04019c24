"""A GGUF file's low-bit weights kept low-bit: the converted folder of a quantized file stores
each quantized linear layer as codes instead of expanding it to fp32, and loads it into the
low-bit kernels. A 463 MB Q4_K_M file then costs about its own size in the cache instead of
2.5 GB, and runs at 4-bit speed.

Stored per layer, in blocks of 32 input features (the GGUF block size): `int4` for files'
4-bit-or-fewer types (codes 0..15 with an fp32 scale and low: llama.cpp's Q4_0 blocks
exactly, Q4_1/Q4_K to an fp32 rounding), `int8` for 5- to 8-bit types (int8 codes with an
fp32 scale: Q8_0 exactly, Q5/Q6 to 8 bits). int4 layers run on the int4 kernel as stored;
int8 layers on the int8 kernel (one scale per row, as `--quant int4` treats the LM head).

Folder: config.json, the tokenizer, `lowbit.safetensors` (`<module>.values`, `.scale`,
`.low`; every other tensor dense) and `lowbit.json` (format, each layer's kind, the
fingerprint of the file's own weights, so accelerators attach as for the dense model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine import quant
from engine.errors import ModelLoadError

MANIFEST = "lowbit.json"
WEIGHTS = "lowbit.safetensors"
FORMAT = 1  # bumped when the stored layout changes; other versions are converted again
DENSE = ("F32", "F16", "BF16")  # GGML types kept as they are
BLOCK = quant.GROUP_SIZE  # input features sharing a scale (the GGUF block size)
CODED = ("int4", "int8")  # kinds stored as codes (int8w layers are stored dense)
KEEP = ("auto", "int4", "int8w")  # --quant choices that run the file's own low bits
EXPAND = {"bf16": torch.bfloat16, "fp32": torch.float32}  # choices that expand them


def kind_of(ggml_type: str) -> str | None:
    """How a layer the file stores as `ggml_type` is kept: `int4` codes (4 bits or fewer),
    `int8` codes (Q8_0), `int8w` (5 or 6 bits: stored dense, exactly, and put on the int8
    kernel when loaded); None: a float layer, stored and run dense."""
    if ggml_type in DENSE:
        return None
    if ggml_type == "Q8_0":
        return "int8"
    return "int8w" if ggml_type.startswith(("Q5", "Q6", "Q8")) else "int4"


def is_lowbit(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def layer_kinds(model: nn.Module, tensors: dict) -> dict[str, str]:
    """{module name: kind} for the linear layers the file stores quantized and the kernels
    take; `tensors`: {parameter name: the file's tensor (gguf's ReaderTensor)}."""
    kinds, tensors = {}, _with_tied_head(model, tensors)
    for name, module in model.named_modules():
        linear = quant._as_linear(module)
        tensor = tensors.get(f"{name}.weight")
        kind = kind_of(tensor.tensor_type.name if tensor is not None else "F32")
        if linear is not None and kind and linear.in_features % BLOCK == 0:
            kinds[name] = kind
    return kinds


def save(model: nn.Module, kinds: dict[str, str], tensors: dict, target: Path,
         fingerprint: str) -> None:
    """Write `model` (fp32, as dequantized from the file) with the layers in `kinds` as codes
    (Q4_0/Q4_1 blocks read as they are in `tensors`, see `layer_kinds`)."""
    from safetensors.torch import save_file

    out, head, tensors = {}, _tied_head(model), _with_tied_head(model, tensors)
    exact = set()  # layers kept as the file's own blocks, value for value
    for name, kind in kinds.items():
        weight = quant._as_linear(model.get_submodule(name)).weight
        if kind == "int4":
            own = _q4_blocks(tensors[f"{name}.weight"], weight)
            exact |= {name} if own is not None else set()
            codes = own or quant.Codes.of(weight, kind)
            out[f"{name}.values"] = _pack_nibbles(codes.values)
            out[f"{name}.low"], out[f"{name}.scale"] = codes.low, codes.scale
        elif kind == "int8":
            out[f"{name}.values"], out[f"{name}.scale"] = _int8_blocks(weight)
    # A tied table is stored once: as the head's codes, else as the embedding.
    shared = _embedding_key(model) if kinds.get(head) in CODED else f"{head}.weight"
    for key, value in model.state_dict().items():
        if kinds.get(key.rpartition(".")[0]) in CODED and key.endswith(".weight"):
            continue  # stored as codes
        if head is not None and key == shared:
            continue
        out[key] = value.detach().contiguous()
    target.mkdir(parents=True, exist_ok=True)
    save_file(out, str(target / WEIGHTS))
    (target / MANIFEST).write_text(json.dumps(
        {"format": FORMAT, "layers": kinds, "fingerprint": fingerprint,
         "exact": sorted(exact)}, indent=1))


@dataclass
class Loaded:
    model: nn.Module
    quant: str  # int4 | int8w (the kind holding most parameters) | bf16 | fp32
    fingerprint: str
    reason: str  # one line for the Models tab
    # every quantized layer runs the file's own blocks exactly (its answers are the file's:
    # --quant auto has nothing to check)
    exact: bool = False


def load(folder: Path, asked: str, device: torch.device) -> Loaded:
    """The folder's model for the --quant choice `asked`: the stored low bits for auto, int4
    and int8w; expanded for bf16 and fp32; bitsandbytes' choices are refused."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    manifest = _manifest(folder)
    if asked not in KEEP and asked not in EXPAND:
        raise ModelLoadError(f"--quant {asked} applies to model folders and hub ids; a GGUF "
                             f"file keeps its own low-bit weights: choose one of "
                             f"{', '.join(KEEP + tuple(EXPAND))}")
    dtype = EXPAND.get(asked, torch.bfloat16)
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = load_file(str(folder / WEIGHTS))
    layers = manifest["layers"]
    coded = {name: kind for name, kind in layers.items() if kind != "int8w"}
    head = _tied_head(model)  # before the head is replaced
    for name, kind in coded.items():
        _place(model, name, _coded_layer(state, name, kind, asked, dtype, device))
    _load_rest(model, state, coded, head)
    if asked in KEEP:
        for name in set(layers) - set(coded):
            linear = model.get_submodule(name)
            if quant.fits(linear, "int8w", device):
                _place(model, name, quant.LowBitLinear.from_linear(linear, "int8w", device))
    model.to(device)
    exact = asked in KEEP and set(layers) <= set(manifest.get("exact", ()))
    return Loaded(model.eval().requires_grad_(False), _label(model, layers, asked),
                  manifest["fingerprint"], _reason(layers, asked), exact)


def _coded_layer(state: dict, name: str, kind: str, asked: str, dtype, device) -> nn.Module:
    """A layer stored as codes: on its kernel for KEEP choices, else expanded to `dtype`."""
    values, scale = state.pop(f"{name}.values"), state.pop(f"{name}.scale")
    bias = state.pop(f"{name}.bias", None)
    if kind == "int4":
        codes = quant.Codes(kind, _unpack_nibbles(values), scale, state.pop(f"{name}.low"))
        dense = codes.dense()
    else:
        dense = _dense_int8(values, scale)
        codes = quant.Codes.of(dense, "int8w")  # the kernel's one scale per row
    shape = nn.Linear(dense.shape[1], dense.shape[0], device="meta")
    if asked in KEEP and quant.fits(shape, codes.kind, device):
        return quant.LowBitLinear(codes, bias, device)
    return _dense_linear(dense, bias, dtype)


def _place(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder / MANIFEST} is unreadable ({exc}): delete the folder "
                             "to convert the GGUF file again") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ModelLoadError(f"{folder} was converted by another version: delete it to "
                             "convert the GGUF file again")
    return manifest


def _load_rest(model: nn.Module, state: dict, layers: dict, head: str | None) -> None:
    """The dense tensors; a tied table becomes the head's (dequantized) weights when the
    head was stored as codes (`layers`: the coded layers), else the head shares the table.
    `head`: the tied head's module name (None: untied)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if head in layers:
        module, key = model.get_submodule(head), _embedding_key(model)
        if isinstance(module, nn.Linear):
            model.get_input_embeddings().weight = module.weight
        else:
            quant.tie_embedding(model)
        missing = [k for k in missing if k != key]
    elif head is not None:
        model.get_submodule(head).weight = model.get_input_embeddings().weight
        missing = [k for k in missing if k != f"{head}.weight"]
    missing = [k for k in missing if k.rpartition(".")[0] not in layers]
    if missing or unexpected:
        raise ModelLoadError(f"the converted folder does not match its model: missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]}: delete it to "
                             "convert the GGUF file again")


def _q4_blocks(tensor, weight: torch.Tensor) -> quant.Codes | None:
    """A Q4_0/Q4_1 tensor's own blocks as int4 codes in `weight`'s row order (transformers
    reorders some layers' rows, e.g. Llama's q/k); None for other types, or where the rows
    are not the file's exactly."""
    import numpy as np

    kind = tensor.tensor_type.name
    if kind not in ("Q4_0", "Q4_1"):
        return None
    rows = weight.shape[0]
    blocks = np.asarray(tensor.data).reshape(-1, 18 if kind == "Q4_0" else 20)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    low = -8 * d if kind == "Q4_0" else blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    nibbles = blocks[:, 2:] if kind == "Q4_0" else blocks[:, 4:]
    values = np.concatenate([nibbles & 15, nibbles >> 4], axis=1)  # low nibbles first
    codes = quant.Codes("int4", torch.from_numpy(values.reshape(rows, -1)),
                        torch.from_numpy(d.reshape(rows, -1)),
                        torch.from_numpy(low.reshape(rows, -1)))
    order = _row_order(codes.dense().numpy(), weight.detach().float().cpu().numpy())
    if order is None:
        return None
    return quant.Codes("int4", codes.values[order], codes.scale[order], codes.low[order])


def _row_order(rows, weight) -> list[int] | None:
    """Indices i_r with rows[i_r] == weight[r] value for value, or None."""
    rows, weight = rows + 0.0, weight + 0.0  # -0.0 -> 0.0: equal values, equal bytes
    where = {row.tobytes(): i for i, row in enumerate(rows)}
    order = [where.get(row.tobytes()) for row in weight]
    return None if None in order or rows.shape != weight.shape else order


def _int8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes with an fp32 scale per block of BLOCK inputs (Q8_0's form)."""
    w = weight.detach().to("cpu", torch.float32)
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1) / 127
    values = (blocks / scale.clamp(min=1e-30)[..., None]).round().clamp(-127, 127)
    return values.to(torch.int8).reshape(n, k), scale


def _dense_int8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = values.shape
    blocks = values.reshape(n, k // BLOCK, BLOCK).float() * scale[..., None]
    return blocks.reshape(n, k)


def _dense_linear(weight: torch.Tensor, bias, dtype: torch.dtype) -> nn.Linear:
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return linear


def _with_tied_head(model: nn.Module, tensors: dict) -> dict:
    """`tensors` where a tied LM head reads the table's tensor (a file stores it once)."""
    head = _tied_head(model)
    if head is None or f"{head}.weight" in tensors:
        return tensors
    table = tensors.get(_embedding_key(model))
    return tensors if table is None else {**tensors, f"{head}.weight": table}


def _tied_head(model: nn.Module) -> str | None:
    """The module name of an LM head that shares the embedding table, else None."""
    head, table = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not table.weight:
        return None
    return next(name for name, module in model.named_modules() if module is head)


def _embedding_key(model: nn.Module) -> str:
    table = model.get_input_embeddings()
    name = next(name for name, module in model.named_modules() if module is table)
    return f"{name}.weight"


def _pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """(N, K) 0..15 -> (N, K/2) uint8, two codes a byte (the file's 4 bits stay 4 bits)."""
    return (values[:, ::2] | values[:, 1::2] << 4).to(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)


def _label(model: nn.Module, layers: dict, asked: str) -> str:
    """The --quant name for what runs: the kernel holding most parameters."""
    if asked not in KEEP:
        return asked
    sizes: dict[str, int] = {}
    for layer in quant.low_bit_layers(model):
        sizes[layer.kind] = sizes.get(layer.kind, 0) + layer.out_features * layer.in_features
    return max(sizes, key=sizes.get) if sizes else "bf16"  # no layer fit the kernels


def _reason(layers: dict, asked: str) -> str:
    counts = {kind: sum(1 for k in layers.values() if k == kind) for kind in set(layers.values())}
    held = ", ".join(f"{kind} for {n} layer{'s' * (n > 1)}" for kind, n in sorted(counts.items()))
    if asked in KEEP:
        return f"the GGUF file's own low-bit weights, kept as stored ({held})"
    return f"the GGUF file's low-bit weights ({held}) expanded to {asked}"

