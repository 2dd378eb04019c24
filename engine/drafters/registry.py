"""Acceleration method name -> a ready drafter for the loaded model."""

from __future__ import annotations

from engine.drafters.base import Drafter
from engine.errors import QuickdraftError

ACCEL_CHOICES = ("off", "lookup", "medusa", "kangaroo")


def load_drafter(lm, method: str) -> Drafter:
    """The drafter for `method`; trained methods load their checkpoint for `lm`.

    Raises AcceleratorError (with the command that fixes it) when none is trained.
    """
    if method == "off":
        return Drafter()
    if method == "lookup":  # model-free: nothing to train or load
        from engine.drafters.lookup import LookupDrafter

        return LookupDrafter()
    if method == "medusa":
        from engine.accelerators import load_checkpoint
        from engine.drafters.medusa import MedusaDrafter

        return MedusaDrafter.from_checkpoint(lm, load_checkpoint(lm, "medusa"))
    if method == "kangaroo":
        from engine.accelerators import load_checkpoint
        from engine.drafters.kangaroo import KangarooDrafter

        return KangarooDrafter.from_checkpoint(lm, load_checkpoint(lm, "kangaroo"))
    raise QuickdraftError(f"unknown acceleration {method!r}: choose one of {', '.join(ACCEL_CHOICES)}")
