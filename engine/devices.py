"""Device and quantization choices: which dtype runs fastest where, and how to load it."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from engine.errors import ModelLoadError

# Fraction of free GPU memory bf16 weights may take before "auto" picks 4-bit: the rest is
# for activations, the KV cache and the drafter.
GPU_WEIGHT_BUDGET = 0.7


def cpu_name() -> str:
    """The processor's model name (what a measurement on this machine is keyed and reported by)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere): what code compiled for
    this machine (-march=native) may use."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def pick_device(requested: str) -> torch.device:
    """'auto' -> CUDA when present, else CPU; 'cuda' without a GPU is an error."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but no CUDA GPU is available")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_quant(requested: str, device: torch.device, weights_bytes: int) -> str:
    """Turn 'auto' into a concrete choice; explicit choices pass through."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        bf16_bytes = weights_bytes // 2 if weights_bytes else 0  # safetensors are often fp32
        return "bf16" if bf16_bytes < GPU_WEIGHT_BUDGET * free else "nf4"
    # On a CPU, bf16 is where Auto starts: engine/quant_auto.py measures fp32, bf16 and the
    # low-bit choices on the model's own answers and speed, and keeps the one it picks.
    return "bf16"


def compute_dtype(quant: str) -> torch.dtype:
    """The activation dtype for a resolved quantization."""
    return torch.float32 if quant == "fp32" else torch.bfloat16


def load_kwargs(quant: str, device: torch.device) -> dict:
    """from_pretrained keyword arguments for a resolved quantization."""
    if quant in ("bf16", "fp32", "int4", "int8w"):  # low-bit: bf16, quantized after loading
        return {"dtype": compute_dtype(quant), "device_map": None}
    from transformers import BitsAndBytesConfig

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise ModelLoadError(f"{quant} needs the bitsandbytes package: {exc}") from exc
    if quant == "nf4":
        bnb = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    else:
        bnb = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": bnb, "dtype": torch.bfloat16, "device_map": {"": device}}
