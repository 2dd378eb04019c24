"""What the Models tab offers before anything is loaded: models already in the Hugging Face
cache and GGUF files in LM Studio's and Ollama's folders, a model's parameter count, the
memory it will take, and a download with progress."""

from __future__ import annotations

import functools
import io
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from app.model_folders import ModelFolders, find_models
from engine import devices, hub
from engine.config import ModelSpec
from engine.decode.loaded import LoadedModel
from engine.errors import ModelLoadError, QuickdraftError
from engine.model.loading import bundled_folder, missing_source
from engine.progress import Progress, ProgressFn
from engine.weights import gguf, gguf_header, gguf_model, memory_fit, quant, quant_auto

log = logging.getLogger(__name__)

# Bytes per parameter of each resolved quantization, where only the parameter count is known
# (a GGUF file; engine/weights/memory_fit.py sizes a folder by its tensors). NF4 packs two
# weights per byte plus (double-quantized) block scales; 8-bit keeps one fp32 scale per row.
# int4 / int8w: codes, scales and the 8-bit LM head, whose codes also serve a tied embedding
# table (the bundled model's tensors measured 0.71 and 1.00). With --wide-copies they also keep bf16
# copies of the weights for steps of many tokens: COPY_BYTES more per parameter.
BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.05, "nf4": 0.55,
                   "int4": 0.75, "int8w": 1.05}
LOW_BIT = ("int4", "int8w")  # the choices that can keep bf16 copies beside their codes
COPY_BYTES = 2.0
LOW_BIT_NOTE = "with --wide-copies: bf16 copies of the weights for steps of many tokens"
# Headroom for activations, the KV cache of a long chat and a drafter, on top of weights.
RUNTIME_OVERHEAD = 1.2

Report = Callable[[str, float | None], None]  # (message, fraction done or None)


def cached_models(cache_dir: Path | None = None) -> list[str]:
    """Repo ids of the models in the Hugging Face cache (`cache_dir`; None: the user's) that
    hold safetensors weights."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except (CacheNotFound, OSError) as exc:
        log.debug("no Hugging Face cache to list: %s", exc)  # usual on a new machine
        return []
    repos = []
    for repo in info.repos:
        files = {f.file_name for rev in repo.revisions for f in rev.files}
        if repo.repo_type == "model" and any(n.endswith(".safetensors") for n in files):
            repos.append(repo.repo_id)
    return sorted(repos, key=str.lower)


def gguf_models(folders: ModelFolders | None = None) -> list[tuple[str, str]]:
    """(label, source) for each GGUF model in LM Studio's and Ollama's folders, the label
    with its file size and the memory it will take once loaded."""
    out = []
    for found in find_models(folders):
        try:
            stat = found.path.stat()
            params = _gguf_parameters(str(found.path), stat.st_size, stat.st_mtime_ns)
            need = _gguf_need(found.path, params, "auto")[1]
            memory = f"~{_size(need)} to run"
        except QuickdraftError as exc:  # listed anyway, with why it cannot be opened
            memory = str(exc).replace(str(found.path), "").strip(" :").split(";")[0]
        label = f"{found.app}: {found.name} · {_size(found.size)} file · {memory}"
        out.append((label, str(found.path)))
    return out


@functools.lru_cache(maxsize=256)
def _gguf_parameters(path: str, _size: int, _mtime_ns: int) -> int:
    """Parameters of a GGUF file; reading a big header takes a while, so the Models tab
    reads each file once (size and mtime in the key: a replaced file is read again)."""
    return gguf.inspect(Path(path)).parameters


def _gguf_need(path: Path, params: int, quant: str) -> tuple[str, int]:
    """(resolved quantization, bytes needed) for a GGUF model: on its own blocks (about the
    file's size) where it runs that way, else once converted (fp32 on disk)."""
    device = devices.pick_device("auto")
    if quant in ("auto", gguf_model.QUANT) and \
            gguf_model.why_not(gguf_header.read(path), device) is None:
        return gguf_model.QUANT, int(path.stat().st_size * RUNTIME_OVERHEAD)
    fit = memory_fit.plan(quant, "auto", device,
                          memory_fit.Checkpoint(params, 0, 0, 0, params * 4, "F32", 0, 0, 0, 0))
    return fit.quant, estimate_bytes(params, fit.quant)


def local_folder(spec: ModelSpec) -> Path | None:
    """The folder `spec` names when it is on this machine already (bundled, local, cached);
    for a GGUF on the hub, its file in the Hugging Face cache."""
    source = spec.source.strip()
    if source == "default":
        return bundled_folder()
    path = Path(source).expanduser()
    if path.exists():
        return path
    hub_gguf = gguf.parse_hub(source)
    if hub_gguf is not None:
        return hub.cached(*hub_gguf, revision=spec.revision)
    return hub.cached(source, revision=spec.revision) if source.count("/") == 1 else None


def measured_size(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, bytes) of a loaded model, measured from its modules. A low-bit layer
    stores packed codes: it counts its logical weights (in x out; its bias is a parameter)
    and the bytes it really holds (codes, scales and any bf16 copy). A tensor two modules
    share (a tied head's bf16 copy is the embedding table) counts once."""
    storages: dict[int, int] = {}  # storage address -> bytes

    def first_time(tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        new = storage.data_ptr() not in storages
        storages[storage.data_ptr()] = storage.nbytes()
        return new

    params = 0
    for module in model.modules():
        for buffer in module.buffers(recurse=False):
            first_time(buffer)
        if isinstance(module, quant.LowBitLinear):
            counted = module.wide is None or first_time(module.wide)
            params += module.in_features * module.out_features if counted else 0
        params += sum(p.numel() for p in module.parameters(recurse=False) if first_time(p))
    return params, sum(storages.values())


def estimate_bytes(params: int, quant: str) -> int:
    """Memory a model with `params` parameters needs in a resolved quantization."""
    return int(params * BYTES_PER_PARAM[quant] * RUNTIME_OVERHEAD)


def memory_estimate(spec: ModelSpec, loaded: LoadedModel | None = None) -> str:
    """One line for the Models tab: the quantization it will load with, its size and the
    free memory; `loaded`: the model loaded from `spec` now, whose bytes are measured."""
    folder = local_folder(spec)
    if folder is None:
        if gguf.parse_hub(spec.source.strip()) is None and (
                why := missing_source(spec.source)) is not None:
            raise ModelLoadError(why)  # a path with nothing there: no download to wait for
        return "Size unknown until downloaded (the download shows its size as it goes)."
    device = devices.pick_device(spec.device)
    if folder.is_file():
        info = gguf.inspect(folder)  # a one-line error when the file cannot be used
        quant, need = _gguf_need(folder, info.parameters, spec.quant)
        params = info.parameters
        how = ("runs on its own blocks" if quant == gguf_model.QUANT
               else "converted once to safetensors")
        model = (f"GGUF {info.architecture} ({'/'.join(info.tensor_types)}), "
                 f"{info.parameters / 1e6:,.0f} M parameters, {_size(info.file_bytes)} file · "
                 f"{how}")
    else:
        checkpoint = memory_fit.read_checkpoint(folder)
        params = checkpoint.parameters
        fit = memory_fit.plan(spec.quant, spec.device, device, checkpoint)
        quant, device = fit.quant, fit.device
        need = fit.needs.get(quant) or estimate_bytes(params, quant)
        model = f"{params / 1e6:,.0f} M parameters ({checkpoint.dtype.lower()})"
        if fit.moved:
            model += f" · on the CPU: {fit.moved}"
    # where the weights will go: the GPU's (CUDA's, or Apple's working set), else RAM
    free = devices.card(device).free_bytes
    if spec.quant == "auto" and device.type == "cpu" and quant != gguf_model.QUANT:
        choices = quant_auto.CANDIDATES
        sizes = ", ".join(f"{q} ~{_size(estimate_bytes(params, q))}" for q in choices)
        need = max(estimate_bytes(params, q) for q in choices)
        line = (f"{model} · Auto on cpu checks {sizes} on held-out questions and speed the "
                f"first time this model loads, and keeps one: up to {_size(need)} needed, "
                f"{_size(free)} free")
    else:
        line = f"{model} · {quant} on {device.type}: about {_size(need)} needed, {_size(free)} free"
        if quant in LOW_BIT and device.type == "cpu" and spec.wide_copies:
            need += int(params * COPY_BYTES * RUNTIME_OVERHEAD)
            line += f" (up to {_size(need)} {LOW_BIT_NOTE})"
    if loaded is not None:
        line += f" · loaded now as {loaded.quant}: {_size(measured_size(loaded.model)[1])} measured"
    if need > free:
        line += " — probably not enough: pick a smaller quantization"
    return line


def download(repo_id: str, revision: str | None, report: Report) -> Path:
    """Fetch a hub model (or, for "owner/name:file.gguf", that one file) into the ordinary
    Hugging Face cache, reporting bytes as they come; ModelLoadError (one line) when it
    cannot."""
    from tqdm.auto import tqdm

    class Reporting(tqdm):
        """A silent tqdm whose byte counters feed `report`."""

        def __init__(self, *args, **kwargs):
            kwargs["disable"] = False
            kwargs["file"] = io.StringIO()  # the UI shows progress, not the terminal
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            super().update(n)
            # Bytes written to disk, against the files' sizes. The hub's other byte bar
            # ("Downloading bytes", network transfer) has no meaningful total.
            if self.unit == "B" and not str(self.desc).startswith("Downloading bytes"):
                frac = min(1.0, self.n / self.total) if self.total else None
                report(f"downloading {repo_id}: {_size(self.n)} of {_size(self.total or 0)}", frac)

    repo, filename = gguf.parse_hub(repo_id) or (repo_id, None)
    return hub.download(repo, filename, revision, tqdm_class=Reporting)


def _size(n: float) -> str:
    if n < 1024**2:
        return f"{n / 1024:.0f} KB"
    if n < 1024**3:
        return f"{n / 1024**2:.0f} MB"
    return f"{n / 1024**3:.1f} GB"


def fetch_if_needed(spec: ModelSpec, report: ProgressFn) -> None:
    """Download a hub model not yet in the cache, with byte progress; ModelLoadError (one
    line: offline, unknown id, gated) when it cannot."""
    source = spec.source.strip()
    if source.count("/") != 1 or local_folder(spec) is not None:  # not a hub id, or here
        return

    def on_bytes(message: str, fraction: float | None) -> None:
        report(Progress("download", fraction or 0.0, 1.0 if fraction is not None else 0, message))

    download(source, spec.revision, on_bytes)
