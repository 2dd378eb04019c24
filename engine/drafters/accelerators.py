"""Accelerator checkpoints: one folder per (model fingerprint, method), self-describing.

    <data_dir>/accelerators/<fingerprint>-<method>/
        drafter.safetensors   weights (never pickle)
        drafter.json          kind, format version, base model, fingerprint, settings
        metrics.json          training and calibration figures

Quickdraft ships accelerators for its bundled model in assets/accelerators/ (same layout):
they load until the user trains their own, which then takes precedence; Retrain continues
from whichever loads.

Loading refuses a checkpoint built for another model, a newer format or a corrupt file.
Every file is read as engine/stored_files.py reads stored files (a regular file under a cap,
never blocking), and the descriptions are checked field by field before anything uses them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.errors import AcceleratorError
from engine.paths import ASSETS, data_dir
from engine.stored_files import MIB, check_regular, read_json

FORMAT_VERSION = 1
WEIGHTS, INFO, METRICS = "drafter.safetensors", "drafter.json", "metrics.json"
JSON_BYTES = 16 * MIB  # drafter.json and metrics.json: a few kB as training writes them
WEIGHTS_BYTES = 16 * 2**30  # a drafter's weights (heads with their own vocabulary: ~1 GB)
# drafter.json's fields that are read, and their types (others are kept, unread)
INFO_TYPES = {"kind": str, "version": int, "fingerprint": str, "base_model_id": str,
              "settings": dict, "data": dict}
TYPE_WORDS = {str: "text", int: "an integer", dict: "an object"}
SHIPPED_DIR = ASSETS / "accelerators"


def shipped_root() -> Path:
    """Where the shipped accelerators are (QUICKDRAFT_SHIPPED_DIR overrides, for packagers
    who install the assets elsewhere)."""
    return Path(os.environ.get("QUICKDRAFT_SHIPPED_DIR") or SHIPPED_DIR)


@dataclass
class Checkpoint:
    """A stored accelerator: weights, description and measured figures."""

    folder: Path
    tensors: dict[str, torch.Tensor]
    info: dict  # drafter.json: kind, version, base_model_id, fingerprint, settings, data
    metrics: dict  # metrics.json


def checkpoint_dir(fingerprint: str, method: str) -> Path:
    """Where training saves the user's own accelerator (restoring the previous one when a save
    died between moving it aside and moving the new one in)."""
    folder = data_dir() / "accelerators" / f"{fingerprint}-{method}"
    old = folder.with_name(folder.name + ".old")
    if not folder.exists() and (old / INFO).is_file():
        try:
            old.rename(folder)
        except OSError:
            pass  # read-only data folder: the next save retries
    return folder


def stored_dir(fingerprint: str, method: str) -> Path:
    """The accelerator that loads: the user's own when one is trained, else the one shipped
    for this model, else the user's (empty) folder, so messages name where training saves."""
    own = checkpoint_dir(fingerprint, method)
    shipped = shipped_root() / own.name
    if (own / INFO).is_file() or not (shipped / INFO).is_file():
        return own
    return shipped


def is_shipped(folder: Path) -> bool:
    """True for an accelerator that came with Quickdraft rather than one trained here."""
    return Path(folder).parent == shipped_root()


def save_checkpoint(lm, method: str, tensors: dict[str, torch.Tensor], settings: dict,
                    metrics: dict, data_summary: dict | None = None) -> Path:
    """Write a checkpoint atomically (a crash or a full disk leaves the old one intact)."""
    folder = checkpoint_dir(lm.fingerprint, method)
    info = {
        "kind": method,
        "version": FORMAT_VERSION,
        "base_model_id": lm.model_id,
        "base_revision": lm.spec.revision,
        "fingerprint": lm.fingerprint,
        "hidden_size": int(lm.model.config.hidden_size),
        "vocab_size": int(lm.model.config.vocab_size),
        "settings": settings,
        "data": data_summary or {},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp / WEIGHTS)
        (tmp / INFO).write_text(json.dumps(info, indent=2))
        (tmp / METRICS).write_text(json.dumps(metrics, indent=2))
        old = folder.with_name(folder.name + ".old")
        if folder.exists():
            shutil.rmtree(old, ignore_errors=True)
            folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise AcceleratorError(f"could not save the {method} accelerator: {exc}") from exc
    return folder


def describe(lm, method: str) -> dict | None:
    """drafter.json + metrics.json of the accelerator that loads, or None when there is none;
    "folder" says where it is."""
    folder = stored_dir(lm.fingerprint, method)
    try:
        info, metrics = read_descriptions(folder)
    except (OSError, ValueError):
        return None
    return {**info, "metrics": metrics, "folder": str(folder)}


def read_descriptions(folder: Path) -> tuple[dict, dict]:
    """drafter.json and metrics.json ({} when absent) of `folder`, read as stored files and
    checked: ValueError (one line) for a file that is not a JSON object or a field of the
    wrong type. FileNotFoundError when there is no drafter.json."""
    info = read_json(folder / INFO, JSON_BYTES)
    if not isinstance(info, dict):
        raise ValueError(f"{INFO} is not a JSON object")
    for key, kind in INFO_TYPES.items():
        if key in info and not (isinstance(info[key], kind) and not isinstance(info[key], bool)):
            raise ValueError(f"{INFO}: {key} must be {TYPE_WORDS[kind]}")
    try:
        metrics = read_json(folder / METRICS, JSON_BYTES)
    except FileNotFoundError:
        metrics = {}
    if not isinstance(metrics, dict):
        raise ValueError(f"{METRICS} is not a JSON object")
    return info, metrics


def load_checkpoint(lm, method: str, folder: Path | None = None) -> Checkpoint:
    """Load and validate the `method` accelerator for `lm` (or the one in `folder`)."""
    folder = folder or stored_dir(lm.fingerprint, method)
    fix = f"run: python launcher.py train --method {method}"
    if not (folder / INFO).is_file():
        raise AcceleratorError(f"no {method} accelerator is trained for this model; {fix}")
    try:
        info, metrics = read_descriptions(folder)
    except (OSError, ValueError) as exc:
        raise AcceleratorError(
            f"the {method} accelerator in {folder} is corrupt ({exc}); {fix}") from exc
    _check_info(info, lm, method, folder, fix)
    try:
        check_regular(folder / WEIGHTS, WEIGHTS_BYTES)  # safetensors opens the path itself
        tensors = load_file(folder / WEIGHTS, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise AcceleratorError(
            f"the {method} accelerator weights in {folder} are corrupt or truncated; {fix}"
        ) from exc
    return Checkpoint(folder, tensors, info, metrics)


def _check_info(info: dict, lm, method: str, folder: Path, fix: str) -> None:
    if info.get("kind") != method:
        raise AcceleratorError(f"{folder} holds a {info.get('kind')!r} accelerator, not {method}")
    check_format(info.get("version"), FORMAT_VERSION, method, folder, "checkpoint", older=True)
    if info.get("fingerprint") != lm.fingerprint:
        raise AcceleratorError(
            f"the {method} accelerator in {folder} was built for another model "
            f"({info.get('base_model_id')}); {fix}"
        )


def check_format(found, expected: int, method: str, folder: Path, part: str,
                 older: bool = False) -> None:
    """Refuse, in one line, a layout (of the checkpoint, or of its drafter's weights) this
    Quickdraft does not read: a newer one is unknown here, an older one's weights do not fit
    (unless `older`: then it still reads). Retraining writes one it reads."""
    if found == expected or (older and isinstance(found, int) and 0 < found < expected):
        return
    if not isinstance(found, int):
        layout = "an unknown layout"
    else:
        layout = "newer than this Quickdraft reads" if found > expected else "an older layout"
    raise AcceleratorError(
        f"the {method} accelerator in {folder} has {part} format {found!r}, not {expected}; "
        f"retrain it ({layout}): run: python launcher.py train --method {method}")


def measured_speedup(metrics: dict) -> float | None:
    """A top-level "speedup", else the best drafting setting calibration measured (None
    where metrics.json holds neither as numbers)."""
    if _is_number(metrics.get("speedup")):
        return float(metrics["speedup"])
    calibration = metrics.get("calibration")
    measured = calibration.get("measured") if isinstance(calibration, dict) else None
    if not isinstance(measured, dict):
        return None
    found = [m.get("speedup") for name, m in measured.items()
             if name != "plain" and isinstance(m, dict)]
    found = [float(x) for x in found if _is_number(x)]
    return max(found) if found else None


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
