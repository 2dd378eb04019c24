"""The acceleration methods: one table from which every list of them is derived (the CLI's
--accel choices, the UI's labels, the trainable methods, the bench's methods), and the
function that turns a method name into a ready drafter for the loaded model."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.drafters import auto
from engine.drafters.base import Drafter
from engine.drafters.datastore import DatastoreDrafter
from engine.drafters.hybrid import kangaroo_lookup, medusa_lookup
from engine.drafters.kangaroo import KangarooDrafter
from engine.drafters.lookup import LookupDrafter, fitted
from engine.drafters.medusa import FIX as MEDUSA_FIX
from engine.drafters.medusa import MedusaDrafter
from engine.drafters.withstore import medusa_datastore
from engine.errors import AcceleratorError, QuickdraftError
from engine.timing import step_cost

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Method:
    """One acceleration method."""

    name: str  # what --accel, the API and the settings file say
    label: str  # what people read
    # (lm, checkpoint or None) -> drafter; for a method that composes others,
    # (lm, {method: drafter}) over those of `composes` that load
    build: Callable
    checkpoint: str | None = None  # the trained accelerator it loads; None: nothing to load
    # The module that trains that accelerator (trainer/ is imported only when training, and
    # the engine never imports it): it offers check(lm), prep_seconds_per_token(lm, options),
    # reserve_s(options), train(...) and summary_lines(metrics, settings).
    trainer: str | None = None
    composes: tuple[str, ...] = ()  # the methods whose drafters it chooses among


METHODS = (
    Method("auto", "Auto", lambda lm, parts: auto.over(lm, parts, ACCEL_LABELS),
           composes=("medusa", "kangaroo", "datastore")),
    Method("off", "Off", lambda lm, ckpt: Drafter()),
    Method("lookup", "Lookup", lambda lm, ckpt: LookupDrafter(fitted(lm))),
    Method("datastore", "Datastore", DatastoreDrafter.for_model),
    Method("medusa", "Medusa", MedusaDrafter.from_checkpoint, "medusa",
           "trainer.medusa.train_heads"),
    Method("medusa+lookup", "Medusa+lookup",
           lambda lm, ckpt: medusa_lookup(MedusaDrafter.from_checkpoint(lm, ckpt)), "medusa"),
    Method("medusa+datastore", "Medusa+datastore", lambda lm, parts: with_medusa(
        parts, lambda m: medusa_datastore(m, parts["datastore"], cost=parts["datastore"].cost
                                          or step_cost(lm))),
        "medusa", composes=("medusa", "datastore")),
    Method("kangaroo", "Kangaroo", KangarooDrafter.from_checkpoint, "kangaroo",
           "trainer.kangaroo.train_adapter"),
    Method("kangaroo+lookup", "Kangaroo+lookup",
           lambda lm, ckpt: kangaroo_lookup(KangarooDrafter.from_checkpoint(lm, ckpt)),
           "kangaroo"),
)
BY_NAME = {m.name: m for m in METHODS}
ACCEL_CHOICES = tuple(BY_NAME)
ACCEL_LABELS = {m.name: m.label for m in METHODS}
TRAINED = tuple(m.name for m in METHODS if m.trainer)  # the methods a user can train


def with_medusa(parts: dict[str, Drafter], build: Callable) -> Drafter:
    """`build(medusa)` for a composition that needs trained Medusa heads; AcceleratorError
    (with the command that trains them) when they did not load."""
    if "medusa" not in parts:
        raise AcceleratorError(f"no Medusa accelerator is trained for this model; {MEDUSA_FIX}")
    return build(parts["medusa"])


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


def checkpoints(name: str) -> tuple[str, ...]:
    """The trained accelerators a method may load, those of the methods it composes included."""
    m = method(name)
    own = (m.checkpoint,) if m.checkpoint else ()
    return own + tuple(c for part in m.composes for c in checkpoints(part))


def load_drafter(lm, name: str, load: Callable | None = None) -> Drafter:
    """The drafter for method `name`; trained methods load their checkpoint for `lm`.
    A method that composes others gets those that load (one that is not trained or is
    unusable here is left out); `load` (lm, method) -> drafter lets a caller share the
    drafters it already holds.

    Raises AcceleratorError (with the command that fixes it) when none is trained."""
    m = method(name)
    if m.composes:
        parts = {}
        for part in m.composes:
            try:
                parts[part] = (load or load_drafter)(lm, part)
            except AcceleratorError as exc:
                log.info("%s leaves %s out: %s", m.label, part, exc)
        return m.build(lm, parts)
    if m.checkpoint is None:
        return m.build(lm, None)
    from engine.accelerators import load_checkpoint

    return m.build(lm, load_checkpoint(lm, m.checkpoint))


def over_datastore(store, lm=None) -> Drafter:
    """The datastore method's drafter over an open datastore (the caller keeps it); with
    `lm`, its conversation lookup drafts as long as lookup does there and its trees are
    sized by the step costs timed there."""
    return DatastoreDrafter(store) if lm is None else DatastoreDrafter.timed(store, lm)
