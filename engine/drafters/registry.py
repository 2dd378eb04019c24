"""The acceleration methods: one table from which every list of them is derived (the CLI's
--accel choices, the UI's labels, the trainable methods, the bench's methods), and the
function that turns a method name into a ready drafter for the loaded model."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from engine.decode.drafter import Drafter
from engine.decode.timing import sampled_cost, step_cost
from engine.drafters.auto import auto
from engine.drafters.composite import Composite
from engine.drafters.datastore_source import StoreDrafter
from engine.drafters.grammar_source import GrammarDrafter
from engine.drafters.kangaroo import KangarooDrafter
from engine.drafters.lookup import LookupDrafter
from engine.drafters.medusa import MedusaDrafter
from engine.errors import AcceleratorError, QuickdraftError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Method:
    """One acceleration method: a drafting source of its own, sources it composes with, or
    both (one rule composes them: engine.drafters.composite)."""

    name: str  # what --accel, the API and the settings file say
    label: str  # what people read
    build: Callable | None = None  # (lm, checkpoint or None) -> its source's drafter
    checkpoint: str | None = None  # the trained accelerator it loads; None: nothing to load
    # The module that trains that accelerator (trainer/ is imported only when training, and
    # the engine never imports it): it offers check(lm), prep_seconds_per_token(lm, options),
    # reserve_s(options), train(...) and summary_lines(metrics, settings).
    trainer: str | None = None
    composes: tuple[str, ...] = ()  # methods whose sources join its own, in join order
    every_source: bool = False  # composes every source that loads here (Auto)
    # Offered as a choice (--accel, the page, the bench). The grammar's source drafts only
    # under a reply's grammar, so alone it is plain decoding: Auto carries it instead.
    listed: bool = True


METHODS = (
    Method("auto", "Auto", every_source=True),
    Method("off", "Off"),
    Method("lookup", "Lookup", lambda lm, ckpt: LookupDrafter.timed(lm)),
    Method("medusa", "Medusa", MedusaDrafter.from_checkpoint, "medusa",
           "trainer.medusa.train_heads"),
    Method("medusa+lookup", "Medusa+lookup", composes=("lookup", "medusa")),
    Method("kangaroo", "Kangaroo", KangarooDrafter.from_checkpoint, "kangaroo",
           "trainer.kangaroo.train_adapter"),
    Method("kangaroo+lookup", "Kangaroo+lookup", composes=("lookup", "kangaroo")),
    Method("datastore", "Datastore", StoreDrafter.for_model, composes=("lookup",)),
    Method("medusa+datastore", "Medusa+datastore", composes=("lookup", "medusa", "datastore")),
    Method("grammar", "Grammar", lambda lm, ckpt: GrammarDrafter(), listed=False),
)
ACCEL_CHOICES = tuple(m.name for m in METHODS if m.listed)
ACCEL_LABELS = {m.name: m.label for m in METHODS}
TRAINED = tuple(m.name for m in METHODS if m.trainer)  # the methods a user can train


def method(name: str) -> Method:
    """The method called `name`; QuickdraftError for an unknown one."""
    for m in METHODS:
        if m.name == name:
            return m
    raise QuickdraftError(
        f"unknown acceleration {name!r}: choose one of {', '.join(ACCEL_CHOICES)}")


def sources(name: str) -> tuple[str, ...]:
    """The sources a method drafts from, in the order their offers are joined (a source
    is named by the method that builds it alone)."""
    m = method(name)
    if m.every_source:
        return tuple(x.name for x in METHODS if x.build is not None)
    found = [s for part in m.composes for s in sources(part)]
    found += [m.name] if m.build is not None else []
    return tuple(dict.fromkeys(found))


def base_method(name: str) -> str | None:
    """The trained accelerator a method is judged by ("medusa+lookup" -> "medusa"); None
    for methods that load none and for Auto."""
    return None if method(name).every_source else next(iter(checkpoints(name)), None)


def checkpoints(name: str) -> tuple[str, ...]:
    """The trained accelerators a method may load, those of its sources included."""
    return tuple(c for c in (method(s).checkpoint for s in sources(name)) if c)


def load_source(lm, name: str) -> Drafter:
    """The drafter of the source `name` alone; trained sources load their checkpoint for
    `lm`. Raises AcceleratorError (with the command that fixes it) when none is trained or
    what is stored cannot be built (a value of the wrong type in its settings, say)."""
    m = method(name)
    if m.checkpoint is None:
        return m.build(lm, None)
    from engine.drafters.accelerators import load_checkpoint

    ckpt = load_checkpoint(lm, m.checkpoint)
    try:
        return m.build(lm, ckpt)
    except AcceleratorError:
        raise
    except Exception as exc:  # stored values the checks above let through
        log.warning("the %s accelerator in %s cannot be built: %s: %s", m.label, ckpt.folder,
                    type(exc).__name__, exc)
        raise AcceleratorError(
            f"the {m.label} accelerator in {ckpt.folder} holds settings this version cannot "
            f"use; retrain it: python launcher.py train --method {m.checkpoint}") from exc


def compose(lm, name: str, source: Callable[[str], Drafter]) -> Drafter:
    """The drafter of method `name` over the sources `source(name)` returns (a caller's
    shared ones): one source alone, or their composite. Auto leaves out a source that is
    not trained or unusable here; another method raises its AcceleratorError."""
    m = method(name)
    names = sources(name)
    if not names:
        return Drafter()
    parts = {}
    for part in names:
        try:
            parts[part] = source(part)
        except AcceleratorError as exc:
            if not m.every_source:
                raise
            log.info("%s leaves %s out: %s", m.label, part, exc)
        except Exception as exc:  # a source broken in a way nobody foresaw: not Auto's end
            if not m.every_source:
                raise
            log.warning("%s leaves %s out: %s: %s", m.label, part, type(exc).__name__, exc)
    if m.every_source:
        return auto(parts, step_cost(lm), ACCEL_LABELS, sampled_cost(lm))
    if len(parts) == 1 and m.checkpoint is not None and parts[name].pays_off:
        return parts[name]  # a trained source alone decides by its own calibration
    # One that does not pay here is a composite without it: plain steps, no states kept.
    # Model-free sources alone go through the rule too: they draft only where their offer
    # beats a plain step (a cheap match is not worth a step that verifies several tokens).
    return Composite(name, parts, step_cost(lm), lead=base_method(name),
                     sampled=sampled_cost(lm))


def over_store(store, lm) -> Drafter:
    """The datastore source over an open datastore (its caller keeps it), its trees sized
    by the step costs timed on `lm`."""
    return StoreDrafter.timed(store, lm)


def load_drafter(lm, name: str) -> Drafter:
    """The drafter for method `name`, its sources loaded for `lm` (see compose)."""
    return compose(lm, name, lambda part: load_source(lm, part))
