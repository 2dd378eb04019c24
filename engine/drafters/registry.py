"""The acceleration methods: one table from which every list of them is derived (the CLI's
--accel choices, the UI's labels, the trainable methods, the bench's methods), and the
function that turns a method name into a ready drafter for the loaded model."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.drafters.base import Drafter
from engine.drafters.datastore import DatastoreDrafter
from engine.drafters.hybrid import KangarooLookupDrafter, MedusaLookupDrafter
from engine.drafters.kangaroo import KangarooDrafter
from engine.drafters.lookup import LookupDrafter, fitted
from engine.drafters.medusa import MedusaDrafter
from engine.errors import AcceleratorError, QuickdraftError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Method:
    """One acceleration method."""

    name: str  # what --accel, the API and the settings file say
    label: str  # what people read
    # (lm, checkpoint or None) -> drafter; None for Auto, which composes the others
    build: Callable | None
    checkpoint: str | None = None  # the trained accelerator it loads; None: nothing to load
    # The module that trains that accelerator (trainer/ is imported only when training, and
    # the engine never imports it): it offers check(lm), prep_seconds_per_token(lm, options),
    # reserve_s(options) and train(...).
    trainer: str | None = None


METHODS = (
    Method("auto", "Auto", None),
    Method("off", "Off", lambda lm, ckpt: Drafter()),
    Method("lookup", "Lookup", lambda lm, ckpt: LookupDrafter(fitted(lm))),
    Method("datastore", "Datastore", DatastoreDrafter.for_model),
    Method("medusa", "Medusa", MedusaDrafter.from_checkpoint, "medusa", "trainer.medusa"),
    Method("medusa+lookup", "Medusa+lookup", MedusaLookupDrafter.from_checkpoint, "medusa"),
    Method("kangaroo", "Kangaroo", KangarooDrafter.from_checkpoint, "kangaroo",
           "trainer.kangaroo"),
    Method("kangaroo+lookup", "Kangaroo+lookup", KangarooLookupDrafter.from_checkpoint,
           "kangaroo"),
)
BY_NAME = {m.name: m for m in METHODS}
ACCEL_CHOICES = tuple(BY_NAME)
ACCEL_LABELS = {m.name: m.label for m in METHODS}
TRAINED = tuple(m.name for m in METHODS if m.trainer)  # the methods a user can train


def method(name: str) -> Method:
    """The method called `name`; QuickdraftError for an unknown one."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise QuickdraftError(
            f"unknown acceleration {name!r}: choose one of {', '.join(ACCEL_CHOICES)}"
        ) from None


def base_method(name: str) -> str | None:
    """The trained accelerator a method loads ("medusa+lookup" -> "medusa"); None for
    methods that load none."""
    return method(name).checkpoint


def load_drafter(lm, name: str) -> Drafter:
    """The drafter for method `name`; trained methods load their checkpoint for `lm`.

    Raises AcceleratorError (with the command that fixes it) when none is trained."""
    m = method(name)
    if m.build is None:
        return load_auto(lm)
    if m.checkpoint is None:
        return m.build(lm, None)
    from engine.accelerators import load_checkpoint

    return m.build(lm, load_checkpoint(lm, m.checkpoint))


def load_auto(lm, load=None) -> Drafter:
    """Auto over the trained accelerators of `lm` (one that is unusable or does not beat
    plain decoding here is left out): copying where a 3-gram match holds, else the one
    with the best calibrated speedup. `load` (lm, method) -> drafter lets a caller share
    the drafters it already holds."""
    from engine.accelerators import describe, measured_speedup
    from engine.drafters.auto import ARM_OF, AutoDrafter, fastest_arm

    load = load or load_drafter
    speedups, trained = {}, {}
    for base in TRAINED:
        try:
            drafter = load(lm, base)
        except AcceleratorError as exc:
            log.info("Auto leaves %s out: %s", base, exc)
            continue
        if drafter.pays:
            trained[ARM_OF[base]] = drafter
            metrics = (describe(lm, base) or {}).get("metrics", {})
            speedups[ARM_OF[base]] = (drafter.retimed_speedup or measured_speedup(metrics)
                                      or 1.0)
    arm = fastest_arm(speedups)
    return AutoDrafter(arm, trained.get("medusa+lookup"), trained.get("kangaroo"),
                       speedup=speedups.get(arm))
