"""Training an accelerator for the host's model in the background, and what the Train tab
says about the model's accelerators and training data."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from app.drafting import accel_label
from app.host import ModelHost, model_name
from app.jobs import Job
from app.store import Store
from engine.drafters.accelerators import describe, is_shipped
from engine.drafters.registry import TRAINED
from engine.errors import QuickdraftError

if TYPE_CHECKING:
    from trainer.pipeline import TrainOptions


class Training:
    """One training run at a time for the host's model (the host refuses a model swap
    while it runs; the accelerators notice the checkpoint it saves)."""

    def __init__(self, store: Store, host: ModelHost):
        self.store = store
        self.host = host

    @property
    def job(self) -> Job | None:
        """The latest training run, if any."""
        return self.host.training

    def start(self, options: TrainOptions, learn_from_chats: bool = True) -> Job:
        """Train an accelerator for the current model in the background, learning from the
        user's chats with it unless told not to. A cancelled run keeps its data, and the
        next run with the same model resumes from it."""
        from trainer.pipeline import train_accelerator

        host = self.host
        if host.training is not None and host.training.running:
            raise QuickdraftError("a training run is already in progress")
        if host.loading is not None and host.loading.running:
            raise QuickdraftError("a model is loading: train once it is ready")
        lm = host.lm
        if learn_from_chats:
            chats = tuple(self.store.chats_with(lm.fingerprint))
            options = dataclasses.replace(options, chats=chats)
        job = Job("train", f"{accel_label(options.method)} for {model_name(lm)}", options.method)
        host.training = job

        def work():
            result = train_accelerator(lm, options, job.report, job.cancel)
            if not job.cancel.is_set():
                self.store.remember(accel="auto")  # Auto now has the new accelerator to choose
            return result

        return job.start(work)

    def cancel(self) -> None:
        if self.host.training is not None:
            self.host.training.cancel.set()


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
