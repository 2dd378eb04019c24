"""The app's engine room: owns the loaded model, runs one generation at a time, knows which
accelerators are trained for that model, and runs the background jobs (loading a model,
training an accelerator). UI modules call these methods and only lay out the results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from app import catalog
from app.jobs import Job
from app.replies import (
    CompareResult,
    ReplyRequest,
    ReplyUpdate,
    add_prompt,
    last_prompt,
    save_reply,
)
from app.store import Settings, Store, own_reply
from engine import neartie
from engine.accelerators import describe, is_shipped, measured_speedup
from engine.chat import conversation, encode, fit_to_context
from engine.config import ChatMessage, ModelSpec, SamplingParams
from engine.config import Conversation as Prompt
from engine.drafters.base import Drafter
from engine.drafters.datastore import open_datastore, store_file
from engine.drafters.registry import (
    ACCEL_CHOICES,
    ACCEL_LABELS,
    TRAINED,
    base_method,
    load_drafter,
    over_datastore,
)
from engine.errors import AcceleratorError, QuickdraftError
from engine.generate import StepEvent, generate, run
from engine.loading import LoadedModel, load_model
from engine.progress import Progress, ProgressFn

if TYPE_CHECKING:
    from trainer.pipeline import TrainOptions

log = logging.getLogger(__name__)

# Compare replays the conversation's last prompt; an empty conversation uses this one.


def accel_label(method: str) -> str:
    """"medusa+lookup" -> "Medusa+lookup"; "auto:lookup" (what Auto used) -> "Auto · Lookup"."""
    if method.startswith("auto:"):
        return f"Auto · {accel_label(method.removeprefix('auto:'))}"
    return ACCEL_LABELS.get(method, method.capitalize())


@dataclass
class AccelStatus:
    """Whether an acceleration method can be used with the loaded model right now."""

    method: str  # one of ACCEL_CHOICES
    ready: bool  # replies can use it now
    train_needed: bool  # no usable accelerator is stored for this model: offer training
    message: str  # one line for people


class Service:
    """Owns the loaded model; one generation (or model swap) at a time."""

    def __init__(self, store: Store, lm: LoadedModel | None = None):
        self.store = store
        self._lm = lm
        self._lock = threading.Lock()  # held by the generation or model swap in progress
        self._cancel = threading.Event()  # Stop: ends the running generation
        self._owner: str | None = None  # the browser session whose generation is running
        self._settings_lock = threading.Lock()  # read-modify-write of the settings file
        self._drafters: dict[str, Drafter] = {}  # ready drafters for self._lm, by method
        self._datastore = None  # the datastore of self._lm's own outputs, once opened
        self.loading: Job | None = None
        self.training: Job | None = None
        self.notice = ""  # shown once on the Models tab, e.g. why the last model did not load
        self.trusted: str | None = None  # the start-up model the command line let run its code

    @classmethod
    def open(cls, store: Store, spec: ModelSpec | None = None) -> Service:
        """Start with `spec`, else the last model used, else the bundled one."""
        settings = store.load_settings()
        service = cls(store)
        if spec is not None and spec.trust_remote_code:
            service.trusted = spec.source
        wanted = spec or ModelSpec(settings.model, settings.quant)
        try:
            service.load_model(wanted)
        except QuickdraftError as exc:
            if wanted.source == "default":
                raise
            service.notice = f"Could not load {wanted.source} ({exc}); using the bundled model."
            service.load_model(ModelSpec())
        return service

    # -- model --------------------------------------------------------------------
    @property
    def lm(self) -> LoadedModel:
        if self._lm is None:
            raise QuickdraftError("no model is loaded: load one on the Models tab")
        return self._lm

    @property
    def busy(self) -> bool:
        """True while a generation or a model swap holds the model."""
        return self._lock.locked()

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
        report = report or (lambda _p: None)
        catalog.fetch_if_needed(spec, report)
        report(Progress("load", 0, 0, f"loading {spec.source} ({spec.quant})"))
        lm = load_model(spec, lambda message: report(Progress("convert", 0, 0, message)))
        with self._lock:  # waits for the reply in progress
            old, self._lm, self._drafters, self._datastore = self._lm, lm, {}, None
        del old
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.remember(model=spec.source, quant=spec.quant)
        report(Progress("done", 1, 1, f"loaded {lm.model_id} as {lm.quant} on {lm.device}"))
        return lm

    # -- acceleration -------------------------------------------------------------
    def accel_status(self, method: str) -> AccelStatus:
        """Can `method` be used now? Loads (and keeps) its drafter when it can."""
        label = accel_label(method)
        if method == "off":
            return AccelStatus(method, True, False, "Plain decoding: one token per model step.")
        if method not in ACCEL_CHOICES:
            raise QuickdraftError(f"unknown acceleration {method!r}")
        if method == "auto":
            return self._auto_status()
        name = model_name(self.lm)
        trained = base_method(method)
        info = describe(self.lm, trained) if trained in TRAINED else {}
        if info is None:
            return AccelStatus(method, False, True,
                               f"{label} is not trained for {name} yet: train it once, "
                               "then switch it on here.")
        try:
            self._drafter(method)
        except AcceleratorError as exc:
            return AccelStatus(method, False, trained in TRAINED,
                               f"{label} cannot be used: {exc}")
        return AccelStatus(method, True, False, _ready_line(label, info))

    def _auto_status(self) -> AccelStatus:
        auto = self._drafter("auto")
        untrained = not any(describe(self.lm, m) for m in TRAINED)
        hint = " Train an accelerator to give it more to choose from." if untrained else ""
        return AccelStatus("auto", True, False, f"{auto.reason()}.{hint}")

    @property
    def datastore(self):
        """The loaded model's datastore; a missing or refused one is rebuilt from the
        self-distilled answers and (unless switched off) the user's chats with it."""
        if self._datastore is None:
            lm = self.lm
            self._datastore = open_datastore(lm, lambda: self._datastore_sources(lm))
        return self._datastore

    def _datastore_sources(self, lm: LoadedModel) -> list[list[int]]:
        from trainer.selfdistill import data_path, load_conversations

        convs = load_conversations(data_path(lm))
        if self.settings().learn_from_chats:
            convs += list(reversed(self.store.chats_with(lm.fingerprint)))  # oldest first
        return [lm.tokenizer.encode(m["content"], add_special_tokens=False)
                for conv in convs for m in conv if m["role"] == "assistant"]

    def _learn(self, reply: dict, token_ids: list[int]) -> None:
        """Put a finished reply in the datastore before the next request starts (the
        rules and the switch of training on chats apply)."""
        lm = self.lm
        if own_reply(reply, lm.fingerprint) and self.settings().learn_from_chats:
            store = self.datastore
            store.add(token_ids)
            store.save(store_file(lm))

    def _drafter(self, method: str) -> Drafter:
        if method == "off":
            return Drafter()
        if method == "datastore" and method not in self._drafters:
            self._drafters[method] = over_datastore(self.datastore, self.lm)
        if method not in self._drafters:
            # Auto shares the Medusa and Kangaroo drafters this service holds.
            self._drafters[method] = load_drafter(self.lm, method,
                                                  lambda _lm, m: self._drafter(m))
        return self._drafters[method]

    # -- chat ---------------------------------------------------------------------
    def chat(self, request: ReplyRequest, prompt: str) -> Iterator[ReplyUpdate]:
        """Add `prompt` to the conversation and stream the reply. The reply is saved when it
        ends, including a partial one after Stop."""
        conversation(prompt)  # refuse an empty prompt before waiting for the model
        return self._reply(request, prompt)

    def regenerate(self, request: ReplyRequest) -> Iterator[ReplyUpdate]:
        """Replace the last reply with a new one."""
        return self._reply(request, None)

    def stop(self, owner: str | None = None) -> None:
        """End the running generation (its partial reply is kept). With `owner`, only when
        that browser session started it: Stop in one tab leaves another tab's reply alone."""
        if owner is None or owner == self._owner:
            self._cancel.set()

    def _reply(self, request: ReplyRequest, prompt: str | None) -> Iterator[ReplyUpdate]:
        with self._lock, self._owned(request.owner):
            conv = self.store.get(request.conv_id)  # under the lock: queued replies keep order
            add_prompt(conv, prompt)
            if request.system is not None:
                conv.system = request.system.strip()
            lm = self.lm
            drafter, used, notices = self._drafter_or_off(request.method)
            turns = conv.turns()
            ids = encode(lm.tokenizer, conversation(turns[-1]["content"], turns[:-1],
                                                    conv.system or None))
            # the model and acceptance rule: what its accelerator may learn from (app.store)
            reply = {"role": "assistant", "content": "", "accel": used,
                     "model": lm.fingerprint, "acceptance": request.params.acceptance}
            conv.messages.append(reply)
            accepted: list[int] = []  # per model step
            token_ids: list[int] = []  # the reply's tokens
            ttft = 0.0
            try:
                events = generate(lm, ids, request.params, drafter, self._cancel)
                for i, event in enumerate(events):
                    reply["content"] = event.full_text
                    token_ids += event.token_ids
                    notices += event.notices
                    if i == 0:
                        ttft = event.elapsed_s  # prefill and the first token
                    else:
                        accepted.append(event.accepted)  # one event per model step
                    if event.done:  # Auto says which arm it drafted with, and why
                        used = reply["accel"] = drafter.used()
                        notices += [line for line in [drafter.reason()] if line]
                    if event.done:  # saved before the last update goes out
                        reply["stats"] = event.stats.to_json()
                        save_reply(self.store, conv, reply)
                        self._learn(reply, token_ids)
                    yield ReplyUpdate(conv, used, event.tokens, event.elapsed_s, ttft,
                                      list(accepted), event.done, event.stats, list(notices))
            finally:  # also when the consumer goes away mid-reply, or on an error
                if "stats" not in reply:
                    save_reply(self.store, conv, reply)

    def complete(self, messages: list[ChatMessage], system: str | None, params: SamplingParams,
                 method: str, cancel: threading.Event) -> Iterator[tuple[StepEvent, str]]:
        """A reply for another tool (the HTTP API), kept out of the stored conversations.
        Takes the same lock as the page's replies: generations never interleave. Yields each
        step's event with the method in use (Auto's arm on the last one)."""
        with self._lock:
            lm = self.lm
            drafter, used, _notices = self._drafter_or_off(method)
            ids = encode(lm.tokenizer, Prompt(tuple(messages), system))
            for event in generate(lm, ids, params, drafter, cancel):
                if event.done:
                    used = drafter.used()
                yield event, used

    @contextlib.contextmanager
    def _owned(self, owner: str):
        """Mark the running generation as `owner`'s; a fresh Stop state for it."""
        self._cancel.clear()
        self._owner = owner
        try:
            yield
        finally:
            self._owner = None

    def _drafter_or_off(self, method: str) -> tuple[Drafter, str, list[str]]:
        status = self.accel_status(method)
        if status.ready:
            drafter = self._drafter(method)  # says why when it decodes plainly here
            return drafter, method, [drafter.notice] if drafter.notice else []
        return Drafter(), "off", [f"{status.message} This reply uses plain decoding."]

    def compare(self, request: ReplyRequest) -> Iterator[CompareResult]:
        """Replay the conversation's last prompt greedily (same length limit and stop
        strings) with acceleration off, then with the request's method."""
        method = request.method
        if method == "off":
            raise QuickdraftError("choose an acceleration method first: Compare runs Off "
                                  "against it")
        with self._lock, self._owned(request.owner):
            conv = self.store.get(request.conv_id) if request.conv_id else None
            prompt, history, system = last_prompt(conv)
            lm = self.lm
            if not self.accel_status(method).ready:
                raise AcceleratorError(f"{accel_label(method)} is not trained for this model yet")
            params = dataclasses.replace(request.params, temperature=0.0, seed=None)
            ids = encode(lm.tokenizer, conversation(prompt, history, system))
            dtype = str(lm.model.dtype).removeprefix("torch.")
            drafter = self._drafter(method)
            warm = dataclasses.replace(params, max_new_tokens=2)
            for each in (None, drafter):  # untimed: neither side pays first-call costs
                run(lm, ids, warm, each, self._cancel)
            _text, off_ids, off = run(lm, ids, params, None, self._cancel)
            yield CompareResult(method, prompt, off, dtype=dtype)
            _text, on_ids, on = run(lm, ids, params, drafter, self._cancel)
            result = CompareResult(method, prompt, off, on, off_ids == on_ids, dtype=dtype)
            if not result.identical and not result.stopped:  # measure the verdict, never assume
                fitted = fit_to_context(ids, lm.context_len, params.max_new_tokens)[0]  # as run()
                result.divergence = neartie.measure(lm, fitted, off_ids, on_ids)
            yield result

    # -- training -----------------------------------------------------------------
    def start_training(self, options: TrainOptions, learn_from_chats: bool = True) -> Job:
        """Train an accelerator for the current model in the background, learning from the
        user's chats with it unless told not to. A cancelled run keeps its data, and the
        next run with the same model resumes from it."""
        from trainer.pipeline import train_accelerator

        method = options.method
        if self.training is not None and self.training.running:
            raise QuickdraftError("a training run is already in progress")
        if self.loading is not None and self.loading.running:
            raise QuickdraftError("a model is loading: train once it is ready")
        lm = self.lm
        if learn_from_chats:
            chats = tuple(self.store.chats_with(lm.fingerprint))
            options = dataclasses.replace(options, chats=chats)
        job = Job("train", f"{accel_label(method)} for {model_name(lm)}", method)
        self.training = job

        def work():
            result = train_accelerator(lm, options, job.report, job.cancel)
            for stale in [m for m in self._drafters if m == "auto" or base_method(m) == method]:
                self._drafters.pop(stale)  # the next use loads the new checkpoint
            if not job.cancel.is_set():
                self.remember(accel="auto")  # Auto now has the new accelerator to choose
            return result

        return job.start(work)

    def cancel_training(self) -> None:
        if self.training is not None:
            self.training.cancel.set()

    # -- settings -----------------------------------------------------------------
    def settings(self) -> Settings:
        return self.store.load_settings()

    def remember(self, **changes) -> Settings:
        """Save some settings for the next launch."""
        with self._settings_lock:
            settings = dataclasses.replace(self.store.load_settings(), **changes)
            self.store.save_settings(settings)
        return settings


def model_name(lm: LoadedModel) -> str:
    """The short name people know a model by (repo name or folder name)."""
    return Path(lm.model_id).name or lm.model_id


def _ready_line(label: str, info: dict) -> str:
    """Status of a trained accelerator from its description (speedup measured here)."""
    metrics = info.get("metrics", {})
    line = f"{label} is ready."
    speedup = measured_speedup(metrics)
    if speedup is not None:
        shipped = "folder" in info and is_shipped(info["folder"])
        where = "on the machine it was built on" if shipped else "when it was trained"
        line += f" Measured {speedup:.2f}× over plain decoding {where}."
    pays = info.get("settings", {}).get("pays", metrics.get("pays"))
    if pays is False:
        line += " It did not beat plain decoding on this machine: Off may be faster."
    return line
