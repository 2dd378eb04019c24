"""Which device runs a model, what it can do, and the dtypes and loading arguments that suit
it. Every choice comes with one line saying why (the CLI and the Models tab show it).

CUDA's capabilities are read from torch (`card`), never assumed: bf16 runs natively from
compute capability 8.0 (Ampere) on, so older cards (Pascal 6.x, Volta 7.0, Turing 7.5)
compute in fp16; PyTorch's int4 kernel (tinygemm) needs 8.0 as well. Apple's GPU (`mps`)
runs the unquantized choices; bf16 there needs macOS 14, which torch reports by refusing it.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from engine.errors import ModelLoadError

TINYGEMM_CAPABILITY = (8, 0)  # PyTorch's CUDA int4 kernel, and native bf16: Ampere and later
# The choices Apple's GPU runs (Quickdraft's and bitsandbytes' low-bit kernels are the CPU's
# and CUDA's only).
MPS_QUANTS = ("fp32", "fp16", "bf16")


def cpu_name() -> str:
    """The processor's model name (what a measurement on this machine is keyed and reported
    by), as torch's cpuinfo reads it on Linux, Windows and macOS alike."""
    return str(torch.cpu.get_capabilities().get("cpu_name") or platform.processor()
               or platform.machine())


def cpu_flags() -> set[str]:
    """The CPU's instruction-set features, named as torch's cpuinfo names them ("avx2",
    "avx512_vnni", "avx512_vl", ...): what code compiled for this machine (-march=native)
    may use."""
    return {name for name, has in torch.cpu.get_capabilities().items() if has is True}


@dataclass(frozen=True)
class Machine:
    """This machine as every cache keyed by it sees it (one reading, `machine()`): what code
    built here may use, and what a timing taken here depends on besides."""

    torch: str  # torch's version
    capability: str  # the vector width torch dispatches to ("AVX2", "AVX512", ...)
    flags: tuple[str, ...]  # the CPU's features, sorted (cpu_flags)
    processor: str  # the CPU's name, or the GPU's where the work runs on one
    threads: int  # torch's CPU threads
    gpu: bool = False  # the processor is a GPU

    @property
    def build_key(self) -> str:
        """What code compiled for this machine depends on: the kernel library and the
        compiled step packages are kept per build_key."""
        return f"torch {self.torch}|{self.capability}|{' '.join(self.flags)}"

    def timing_key(self, kernels: str) -> str:
        """What a timing taken here depends on besides the model: the processor, the
        threads, torch and whose low-bit kernels ran (`kernels`)."""
        return f"torch {self.torch}|{self.processor}|{self.threads}t|{kernels}"

    def describe(self, kernels: str = "") -> str:
        """timing_key's facts in words, for what a calibration records."""
        where = self.processor if self.gpu else f"{self.processor}, {self.threads} threads"
        return ", ".join(part for part in (where, kernels, f"torch {self.torch}") if part)


def machine(device: torch.device | None = None) -> Machine:
    """This machine, with the GPU's name as its processor where `device` is a CUDA one."""
    gpu = device is not None and device.type == "cuda"
    processor = torch.cuda.get_device_name(device) if gpu else cpu_name()
    return Machine(torch.__version__, torch.backends.cpu.get_cpu_capability(),
                   tuple(sorted(cpu_flags())), processor, torch.get_num_threads(), gpu)


@dataclass(frozen=True)
class Card:
    """What the device a model runs on can do, as torch reports it (tests fake the queries)."""

    kind: str  # "cuda" | "mps" | "cpu"
    name: str  # "NVIDIA GeForce RTX 3060", "Apple GPU (mps)" or the CPU's model name
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability; (0, 0) elsewhere
    free_bytes: int = 0  # memory free for a model now
    total_bytes: int = 0  # the device's memory
    bf16: bool = True  # computes in bf16 natively (else fp16 is the fast half precision)

    @property
    def half(self) -> str:
        """The 16-bit choice this device computes fastest: bf16, else fp16."""
        return "bf16" if self.bf16 else "fp16"

    @property
    def tinygemm(self) -> bool:
        """Whether PyTorch's CUDA int4 kernel runs here (compute capability 8.0 and later)."""
        return self.kind == "cuda" and self.capability >= TINYGEMM_CAPABILITY

    def line(self) -> str:
        """The device in a few words: name, capability, memory."""
        if self.kind == "cuda":
            major, minor = self.capability
            return (f"{self.name}, compute capability {major}.{minor}, "
                    f"{self.free_bytes / 2**30:.1f} of {self.total_bytes / 2**30:.1f} GB free")
        if self.kind == "mps":
            return f"{self.name}, {self.free_bytes / 2**30:.1f} GB for the GPU"
        return self.name


def card(device: torch.device) -> Card:
    """What `device` can do, read from torch now (free memory changes as others use it)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return Card("cuda", torch.cuda.get_device_name(device),
                    tuple(torch.cuda.get_device_capability(device)), int(free), int(total),
                    native_bf16(device))
    if device.type == "mps":
        # Metal's working-set budget for this process, less what it holds already
        budget = int(torch.mps.recommended_max_memory())
        free = budget - int(torch.mps.driver_allocated_memory())
        return Card("mps", "Apple GPU (mps)", (0, 0), free, budget, native_bf16(device))
    import psutil

    memory = psutil.virtual_memory()
    return Card("cpu", cpu_name(), (0, 0), int(memory.available), int(memory.total), True)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 natively: a CUDA card from compute capability 8.0 on
    (torch emulates it on older ones, slowly), Apple's GPU where torch runs it, any CPU
    (the CPU paths are measured in bf16)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    if device.type == "mps":
        return mps_runs(torch.bfloat16)
    return True


def mps_runs(dtype: torch.dtype) -> bool:
    """Whether Apple's GPU computes in `dtype` here (bf16 needs macOS 14: torch refuses it
    on older systems)."""
    try:
        return bool((torch.ones(2, dtype=dtype, device="mps") * 2).sum().item() == 4)
    except (RuntimeError, TypeError):
        return False


def pick_device(requested: str) -> torch.device:
    """'auto' -> CUDA when present, else Apple's GPU when present, else the CPU; 'cuda' or
    'mps' without one is an error that says why."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device 'cuda' requested but {no_cuda_reason()}")
    if requested == "mps" and not mps_available():
        raise ModelLoadError("device 'mps' requested but this PyTorch sees no Apple GPU")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda")
    if requested in ("auto", "mps") and mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def no_cuda_reason() -> str:
    """Why torch sees no CUDA GPU, as far as it can say."""
    if torch.version.cuda is None:
        return ("this PyTorch is a CPU build (an NVIDIA GPU the launcher did not find: "
                "delete .venv and run `python launcher.py` again once `nvidia-smi` works)")
    return f"this PyTorch (CUDA {torch.version.cuda}) sees no GPU (driver not loaded?)"


def device_line(requested: str, device: torch.device, moved: str = "") -> str:
    """Which device runs and why, in one line. `moved`: why the model left the device
    first picked (it did not fit there, or its weights do not run there)."""
    what = card(device).line()
    if moved:
        return f"{device.type} ({what}): {moved}"
    if requested != "auto":
        return f"{device.type} ({what}), as asked"
    if device.type == "cuda":
        return f"cuda ({what}): the GPU PyTorch found"
    if device.type == "mps":
        return f"mps ({what}): Apple's GPU, no CUDA GPU here"
    why = "no Apple GPU either" if platform.system() == "Darwin" else no_cuda_reason()
    return f"cpu ({what}): no CUDA GPU: {why}"


def compute_dtype(quant: str, device: torch.device | None = None) -> torch.dtype:
    """The activation dtype for a resolved quantization on `device`: bf16 unless the
    choice is fp32 or fp16, or the device is a CUDA card without native bf16 (fp16)."""
    if quant == "fp32":
        return torch.float32
    if quant == "fp16":
        return torch.float16
    if device is not None and device.type != "cpu" and not native_bf16(device):
        return torch.float16
    return torch.bfloat16


def load_kwargs(quant: str, device: torch.device) -> dict:
    """from_pretrained keyword arguments for a resolved quantization."""
    dtype = compute_dtype(quant, device)
    if quant in ("bf16", "fp16", "fp32", "int4", "int8w"):  # low-bit: quantized as it loads
        return {"dtype": dtype, "device_map": None}
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
            bnb_4bit_compute_dtype=dtype,  # fp16 on cards without native bf16
        )
    else:
        bnb = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": bnb, "dtype": dtype, "device_map": {"": device}}


def staged(values, device: torch.device) -> torch.Tensor:
    """`values` (a list of numbers, nested or not, or a tensor) as a tensor on `device`: what
    a decode step sends its device each step (token ids, positions, a tree's mask).

    A GPU gets them from a fresh pinned host copy, sent without waiting: a copy out of
    pageable memory can hold the host until the GPU has run everything queued before it,
    a stall in every step. Being fresh, the copy leaves the caller free to change `values`
    at once; PyTorch's caching host allocator reuses its block only once the transfer out
    of it has run. Elsewhere the plain tensor, as built."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
    return pinned.to(device, non_blocking=True)
