"""The model host: owns the loaded model, swaps it in the background, and holds the lock a
generation or a model swap takes, so there is one at a time."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app import catalog
from app.jobs import Job
from app.store import Store
from engine.config import ModelSpec
from engine.decode.loaded import LoadedModel
from engine.errors import QuickdraftError
from engine.model.loading import load_model, start_compiling
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
        # The compiled step's build for the loaded model, while a builder process works on
        # it (its latest report; None otherwise): the page's header shows it.
        self.compiling: Progress | None = None
        self.echo: ProgressFn | None = None  # the terminal's progress line, where there is one

    @property
    def lm(self) -> LoadedModel:
        if self._lm is None:
            if self.loading is not None and self.loading.running:
                raise QuickdraftError(f"the model is still loading ({self.loading.title}): "
                                      "try again in a moment")
            raise QuickdraftError("no model is loaded: load one on the Models tab")
        return self._lm

    def wait_ready(self) -> LoadedModel:
        """The loaded model, once the start-up load (the page is served before it is done)
        has finished; its error where it failed."""
        job = self.loading
        if self._lm is None and job is not None and job.running:
            job.wait()
        return self.lm

    @property
    def current(self) -> LoadedModel | None:
        """The loaded model, or None (where no model is a state to show, not an error)."""
        return self._lm

    @property
    def busy(self) -> bool:
        """True while a generation or a model swap holds the model."""
        return self.lock.locked()

    def start_load(self, spec: ModelSpec, first: bool = False) -> Job:
        """Load `spec` in the background; the current model keeps working until it is ready.
        `first`: the start-up model, which falls back to the bundled one (saying why in
        `notice`) where it cannot be loaded."""
        if self.loading is not None and self.loading.running:
            raise QuickdraftError("a model is already loading")
        # only the start-up model named on the command line may run its own code
        spec = dataclasses.replace(spec, trust_remote_code=spec.source == self.trusted)
        job = Job("load", spec.source)
        self.loading = job
        load = self.load_first if first else self.load_model
        return job.start(lambda: load(spec, self._told(job.report)))

    def load_first(self, spec: ModelSpec, report: ProgressFn | None = None) -> LoadedModel:
        """The start-up model: `spec`, else the bundled one where `spec` cannot be loaded."""
        try:
            return self.load_model(spec, report)
        except QuickdraftError as exc:
            if spec.source == "default":
                raise
            self.notice = f"Could not load {spec.source} ({exc}); using the bundled model."
            return self.load_model(ModelSpec(), report)

    def _told(self, report: ProgressFn) -> ProgressFn:
        """`report`, and the terminal where one listens (`echo`)."""
        if self.echo is None:
            return report
        return lambda progress: (report(progress), self.echo(progress))

    def load_model(self, spec: ModelSpec, report: ProgressFn | None = None) -> LoadedModel:
        """Load `spec` and make it current. On any error the previous model stays loaded."""
        if self.training is not None and self.training.running:
            raise QuickdraftError("an accelerator is training for the current model: "
                                  "cancel it (Train tab) before loading another model")
        report = report or ignore
        spec = dataclasses.replace(spec, step=self.step)
        catalog.fetch_if_needed(spec, report)
        report(Progress("load", 0, 0, f"loading {spec.source} ({spec.quant})"))
        lm = load_model(spec, lambda message: report(Progress("load", 0, 0, message)))
        with self.lock:  # waits for the reply in progress
            old, self._lm = self._lm, lm
            for forget in self.on_swap:
                forget()
        del old
        # The compiled step loads at once where it was built before; else a builder process
        # builds it, and the accelerators are re-timed on it once it is ready.
        self.compiling = None
        start_compiling(lm, "watch", on_ready=lambda: self._retime(lm),
                        report=lambda progress: self._compiling(lm, progress))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.store.remember(model=spec.source, quant=spec.quant)
        report(Progress("done", 1, 1, f"loaded {lm.model_id} as {lm.quant} on {lm.device}"))
        return lm


    def _compiling(self, lm: LoadedModel, progress: Progress) -> None:
        if self._lm is lm:
            self.compiling = progress
            if self.echo is not None:
                self.echo(progress)

    def activity(self) -> str:
        """What the host is doing that takes a while, in one line ("" when nothing): the
        start-up load's current stage, or the compiled step's build (the page's header
        shows it as it goes)."""
        job = self.loading
        if job is not None and job.running:
            p = job.progress
            what = p.message if p is not None and p.message else f"loading {job.title}"
            return f"{what} · {time.monotonic() - job.started:.0f} s{_eta(p)}"
        lm, p = self._lm, self.compiling
        if lm is not None and p is not None and lm.target.name == "lean-compiling":
            return (f"{p.message}{_eta(p)} · replies meanwhile on the eager step "
                    "(the same replies, slower)")
        return ""

    def _retime(self, lm: LoadedModel) -> None:
        """The decode step got faster (compiled): what was built on the old step's
        timings is dropped and rebuilt on the new ones when next asked for."""
        with self.lock:
            if self._lm is lm:
                for forget in self.on_swap:
                    forget()


def _eta(p: Progress | None) -> str:
    return f", about {p.eta_s:.0f} s left" if p is not None and p.eta_s is not None else ""


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
    """How decode steps run for `lm` now, in words (engine/decode/target.py's state)."""
    return STEP_WORDS.get(lm.target.name, lm.target.name)
