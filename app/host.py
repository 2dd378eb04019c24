"""The model host: owns the loaded model, swaps it in the background, and holds the lock a
generation or a model swap takes, so there is one at a time."""

from __future__ import annotations

import dataclasses
import gc
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from app import catalog
from app.jobs import Job
from app.store import Store
from engine.config import ModelSpec
from engine.errors import QuickdraftError
from engine.loading import LoadedModel, load_model, start_compiling
from engine.progress import Progress, ProgressFn, ignore


class ModelHost:
    """Owns the loaded model; one generation (or model swap) at a time holds `lock`."""

    def __init__(self, store: Store, lm: LoadedModel | None = None):
        self.store = store  # its settings file remembers the model for the next launch
        self._lm = lm
        self.lock = threading.Lock()  # held by the generation or model swap in progress
        self.loading: Job | None = None
        self.training: Job | None = None  # the training run using the model (app.training)
        self.notice = ""  # shown once on the Models tab, e.g. why the last model did not load
        self.trusted: str | None = None  # the start-up model the command line let run its code
        self.step = "auto"  # how decode steps run for every model loaded (engine/config.py)
        # Called under the lock when the model changes: drop what was built for the old one.
        self.on_swap: list[Callable[[], None]] = []

    @property
    def lm(self) -> LoadedModel:
        if self._lm is None:
            raise QuickdraftError("no model is loaded: load one on the Models tab")
        return self._lm

    @property
    def current(self) -> LoadedModel | None:
        """The loaded model, or None (where no model is a state to show, not an error)."""
        return self._lm

    @property
    def busy(self) -> bool:
        """True while a generation or a model swap holds the model."""
        return self.lock.locked()

    def start_load(self, spec: ModelSpec) -> Job:
        """Load `spec` in the background; the current model keeps working until it is ready."""
        if self.loading is not None and self.loading.running:
            raise QuickdraftError("a model is already loading")
        # only the start-up model named on the command line may run its own code
        spec = dataclasses.replace(spec, trust_remote_code=spec.source == self.trusted)
        job = Job("load", spec.source)
        self.loading = job
        return job.start(lambda: self.load_model(spec, job.report))

    def load_model(self, spec: ModelSpec, report: ProgressFn | None = None) -> LoadedModel:
        """Load `spec` and make it current. On any error the previous model stays loaded."""
        if self.training is not None and self.training.running:
            raise QuickdraftError("an accelerator is training for the current model: "
                                  "cancel it (Train tab) before loading another model")
        report = report or ignore
        spec = dataclasses.replace(spec, step=self.step)
        catalog.fetch_if_needed(spec, report)
        report(Progress("load", 0, 0, f"loading {spec.source} ({spec.quant})"))
        lm = load_model(spec, lambda message: report(Progress("convert", 0, 0, message)))
        with self.lock:  # waits for the reply in progress
            old, self._lm = self._lm, lm
            for forget in self.on_swap:
                forget()
        del old
        # The compiled step loads at once where it was built before; else it is built in
        # the background, and the accelerators are re-timed on it once it is ready.
        start_compiling(lm, on_ready=lambda: self._retime(lm))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.store.remember(model=spec.source, quant=spec.quant)
        report(Progress("done", 1, 1, f"loaded {lm.model_id} as {lm.quant} on {lm.device}"))
        return lm


    def _retime(self, lm: LoadedModel) -> None:
        """The decode step got faster (compiled): what was built on the old step's
        timings is dropped and rebuilt on the new ones when next asked for."""
        with self.lock:
            if self._lm is lm:
                for forget in self.on_swap:
                    forget()


def model_name(lm: LoadedModel) -> str:
    """The short name people know a model by (repo name or folder name)."""
    return Path(lm.model_id).name or lm.model_id


STEP_WORDS = {
    "lean-compiled": "compiled (the lean step, built once for this model and machine)",
    "lean-graphs": "CUDA graphs (the lean step, captured once per step size)",
    "lean-compiling": "eager while the compiled step is being built (first start only)",
    "lean-eager": "the lean step, eager",
    "lean-eager (compiling failed)": "the lean step, eager: compiling it failed here",
    "transformers": "transformers' own forward (this model's family has no lean step)",
}


def step_line(lm: LoadedModel) -> str:
    """How decode steps run for `lm` now, in words (engine/target.py's state)."""
    return STEP_WORDS.get(lm.target.name, lm.target.name)
