"""What the Train tab says about the current model's accelerators and training data."""

from __future__ import annotations

from app.service import accel_label
from app.store import Store
from engine.accelerators import describe, is_shipped
from engine.drafters.registry import TRAINED


def training_summary(lm, store: Store) -> str:
    """One line per trainable method for `lm`, the self-distilled data kept, and how many
    of the user's chats with this model a run would learn from."""
    from trainer.selfdistill import data_path

    lines = []
    for method in TRAINED:
        info = describe(lm, method)
        if info is None:
            state = "not trained yet"
        elif is_shipped(info["folder"]):
            state = "shipped with Quickdraft (Retrain fits it to this machine and your chats)"
        else:
            state = f"trained {info.get('created', '')[:16]}"
        lines.append(f"{accel_label(method)}: {state}")
    try:
        with open(data_path(lm), encoding="utf-8") as f:
            kept = sum(1 for _ in f)
    except OSError:
        kept = 0
    if kept:
        lines.append(f"{kept} self-distilled conversations kept from earlier runs "
                     "(the next run continues from them)")
    chats = len(store.chats_with(lm.fingerprint))
    lines.append(f"{chats} of your conversations with this model to learn from")
    return " · ".join(lines)
