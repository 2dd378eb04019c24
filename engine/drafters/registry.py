"""Acceleration method name -> a ready drafter for the loaded model."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.drafters.base import Drafter
from engine.errors import AcceleratorError, QuickdraftError
from engine.paths import data_dir

log = logging.getLogger(__name__)

ACCEL_CHOICES = ("auto", "off", "lookup", "medusa", "medusa+lookup", "kangaroo",
                 "kangaroo+lookup")
ACCEL_LABELS = {"auto": "Auto", "off": "Off", "lookup": "Lookup", "medusa": "Medusa",
                "medusa+lookup": "Medusa+lookup", "kangaroo": "Kangaroo",
                "kangaroo+lookup": "Kangaroo+lookup"}
TRAINED = ("medusa", "kangaroo")  # the methods that need a trained checkpoint


def base_method(method: str) -> str:
    """The trained accelerator a method needs ("medusa+lookup" -> "medusa")."""
    return method.split("+", 1)[0]


def load_drafter(lm, method: str, remember: bool = True) -> Drafter:
    """The drafter for `method`; trained methods load their checkpoint for `lm`.

    Raises AcceleratorError (with the command that fixes it) when none is trained. `remember`:
    Auto keeps its speed figures for this model in the data folder (False: this run only).
    """
    if method == "off":
        return Drafter()
    if method == "lookup":  # model-free: nothing to train or load
        from engine.drafters.lookup import LookupDrafter

        return LookupDrafter()
    if method == "auto":
        return load_auto(lm, remember)
    if method not in ACCEL_CHOICES:
        raise QuickdraftError(
            f"unknown acceleration {method!r}: choose one of {', '.join(ACCEL_CHOICES)}")
    from engine.accelerators import load_checkpoint

    return _trained_class(method).from_checkpoint(lm, load_checkpoint(lm, base_method(method)))


def _trained_class(method: str):
    from engine.drafters import hybrid
    from engine.drafters.kangaroo import KangarooDrafter
    from engine.drafters.medusa import MedusaDrafter

    return {"medusa": MedusaDrafter, "kangaroo": KangarooDrafter,
            "medusa+lookup": hybrid.MedusaLookupDrafter,
            "kangaroo+lookup": hybrid.KangarooLookupDrafter}[method]


def auto_figures_path(lm) -> Path:
    """Where Auto keeps the speeds it measured for this model, device and dtype."""
    return data_dir() / "auto" / lm.fingerprint / f"{lm.device.type}-{lm.quant}.json"


def load_auto(lm, remember: bool = True, load=None):
    """Auto over plain decoding, lookup and each trained accelerator (one that is unusable or
    measured no faster than plain decoding is left out). `load` (lm, method) -> drafter lets
    a caller share the drafters it already holds."""
    from engine.accelerators import describe, measured_speedup
    from engine.drafters.auto import AutoDrafter
    from engine.drafters.auto_figures import load_figures, plain_step_seconds, priors

    load = load or load_drafter
    # Lookup has no calibration: a modest gain is assumed until steps measure it.
    speedups, trained = {"off": 1.0, "lookup": 1.1}, {}
    for base in TRAINED:
        method = f"{base}+lookup"
        try:
            drafter = load(lm, method)
        except AcceleratorError as exc:
            log.info("Auto leaves %s out: %s", base, exc)
            continue
        if drafter.pays:
            trained[base] = drafter
            metrics = (describe(lm, base) or {}).get("metrics", {})
            speedups[method] = drafter.retimed_speedup or measured_speedup(metrics) or 1.0
    path = auto_figures_path(lm) if remember else None
    figures = load_figures(path, priors(plain_step_seconds(lm), speedups))
    return AutoDrafter(figures, trained.get("medusa"), trained.get("kangaroo"), path)
