"""The accelerators of the loaded model: whether each method can be used now, its ready
drafter, and the datastore of the model's own replies. What is stored on disk is read again
only when a checkpoint's folder changes (training saved one, or one was copied in); the
drafters that load it are rebuilt then."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.conversation import own_reply
from app.host import ModelHost, model_name
from app.settings_rules import text_problem
from app.speed_record import CpuWatch, SpeedRecord
from app.speed_words import Taken, measured_lines, ready_line, slower, speed_words, what_auto_does
from app.store import Store
from app.store_writer import StoreWriter
from engine.decode.drafter import Drafter
from engine.decode.loaded import LoadedModel
from engine.drafters.accelerators import (
    INFO,
    METRICS,
    checkpoint_dir,
    describe,
    is_shipped,
    measured_speedup,
    shipped_root,
)
from engine.drafters.datastore_source import open_datastore, store_file
from engine.drafters.registry import (
    ACCEL_CHOICES,
    ACCEL_LABELS,
    TRAINED,
    base_method,
    checkpoints,
    compose,
    load_source,
    over_store,
)
from engine.errors import AcceleratorError, QuickdraftError


def accel_label(method: str) -> str:
    """"medusa+lookup" -> "Medusa+lookup"; "auto:lookup" (what Auto used) -> "Auto · Lookup"."""
    if method.startswith("auto:"):
        return f"Auto · {accel_label(method.removeprefix('auto:'))}"
    return ACCEL_LABELS.get(method, method.capitalize())


@dataclass
class Resolved:
    """The drafter a reply uses and what the reply says about it."""

    drafter: Drafter
    method: str  # the method in use ("off" where the one asked for cannot be used now)
    notices: list[str] = field(default_factory=list)  # e.g. it fell back to plain decoding


@dataclass
class AccelStatus:
    """Whether an acceleration method can be used with the loaded model right now."""

    method: str  # one of ACCEL_CHOICES
    ready: bool  # replies can use it now
    train_needed: bool  # no usable accelerator is stored for this model: offer training
    message: str  # one line for people


class Accelerators:
    """Ready drafters, stored descriptions and the datastore for the host's model, kept until
    it changes."""

    def __init__(self, store: Store, host: ModelHost):
        self.store = store
        self.host = host
        self._drafters: dict[str, Drafter] = {}  # ready drafters for host.lm, by method
        self._sources: dict[str, Drafter] = {}  # their sources, shared, by source name
        self._found: dict[str, tuple] = {}  # checkpoint -> (folder stamp, describe())
        self._datastore = None  # the datastore of host.lm's own outputs, once opened
        self._for: LoadedModel | None = None  # the model all of the above were built for
        # when each source and method was built (its estimates timed) and how busy the
        # machine was meanwhile, and what replies measured: for host.lm's step as it is now
        self.taken: dict[str, Taken] = {}
        self.record = SpeedRecord()
        self.writer = StoreWriter()  # the datastore's disk writes, outside replies
        host.on_swap.append(self.forget)

    def forget(self) -> None:
        """Drop everything built for the model (it is being swapped)."""
        self._drafters, self._sources, self._found = {}, {}, {}
        self._datastore, self._for = None, None
        self.taken, self.record = {}, SpeedRecord()

    def _sync(self) -> LoadedModel:
        """The host's model, after dropping what was built for another: a build that was
        still running when the model was swapped may have kept its drafter after `forget`."""
        lm = self.host.lm
        if self._for is not lm:
            self.forget()
            self._for = lm
        return lm

    def status(self, method: str) -> AccelStatus:
        """Can `method` be used now? Loads (and keeps) its drafter when it can."""
        if method == "off":
            return AccelStatus(method, True, False, "Plain decoding: one token per model step.")
        if method not in ACCEL_CHOICES:
            raise QuickdraftError(f"unknown acceleration {str(method)[:40]!r}")
        label = accel_label(method)
        self._sync()
        if method == "auto":
            return self._auto_status()
        trained = base_method(method)
        info = self._describe(trained) if trained in TRAINED else {}
        if info is None:
            return AccelStatus(method, False, True,
                               f"{label} is not trained for {model_name(self.host.lm)} yet: "
                               "train it once, then switch it on here.")
        try:
            drafter = self.drafter(method)
        except AcceleratorError as exc:
            return AccelStatus(method, False, trained in TRAINED, f"{label} cannot be used: {exc}")
        speed = self._speed(label, trained, drafter) if trained in TRAINED else ""
        return AccelStatus(method, True, False, ready_line(label, speed, drafter))

    def _auto_status(self) -> AccelStatus:
        """How Auto drafts with what is trained here, and how fast its trained arm is (a
        figure re-timed at each load, so it is said where it comes from)."""
        auto = self.drafter("auto")
        arm = auto.used().partition(":")[2] or "off"
        store = ", from the datastore of its earlier replies where it is confident" \
            if "datastore" in getattr(auto, "sources", {}) else ""
        if arm == "off":
            line = (f"Auto copies from this conversation where it can{store}, else decodes "
                    "plainly: no trained accelerator beats plain decoding here.")
        else:
            speed = self._speed(accel_label(arm), arm, self.source(arm))
            line = (f"Auto copies from this conversation where it can{store}, else drafts with "
                    f"{accel_label(arm)}. {speed}")
        if not any(self._describe(m) for m in TRAINED):
            line += " Train an accelerator to give it more to choose from."
        return AccelStatus("auto", True, False, line)

    def _speed(self, label: str, checkpoint: str, drafter: Drafter) -> str:
        info = self._describe(checkpoint) or {}
        shipped = "folder" in info and is_shipped(info["folder"])
        return speed_words(label, measured_speedup(info.get("metrics", {})),
                           drafter.retimed_speedup, shipped, self.taken.get(checkpoint))

    def measured(self, method: str) -> list[str]:
        """What replies and Compare measured for `method` here (app/speed_words.py), and,
        where that is slower than Off, what Auto does about it."""
        lines = measured_lines(method, accel_label(method), self.record)
        ratio = slower(method, self.record) if method != "off" else None
        return lines + ([self.slower_note(method, ratio)] if ratio is not None else [])

    def slower_note(self, method: str, ratio: float) -> str:
        """`method` ran at `ratio` (< 1) times Off here: what Auto does about it."""
        trained = base_method(method) if method != "auto" else None
        drafter = self.source(trained) if trained else self.drafter(method)
        return what_auto_does(method, accel_label(method), ratio, drafter,
                              self.taken.get(trained or method))

    def drafter(self, method: str) -> Drafter:
        """The ready drafter of `method` (AcceleratorError when it cannot be built)."""
        if method == "off":
            return Drafter()
        lm = self._sync()
        for checkpoint in checkpoints(method):
            self._describe(checkpoint)  # drops drafters whose checkpoint changed
        if method not in self._drafters:
            # Methods share the sources held here.
            watch = CpuWatch()
            self._drafters[method] = compose(lm, method, self.source)
            self.taken.setdefault(method, Taken(time.time(), watch.busy()))
        return self._drafters[method]

    def source(self, name: str) -> Drafter:
        """The shared drafter of the source `name` (the datastore's over the one kept here)."""
        if name not in self._sources:
            lm = self._sync()
            watch = CpuWatch()  # a trained source re-times itself while it loads
            self._sources[name] = (over_store(self.datastore, lm)
                                   if name == "datastore" else load_source(lm, name))
            self.taken[name] = Taken(time.time(), watch.busy())
        return self._sources[name]

    def resolve(self, method: str, strict: bool = False) -> Resolved:
        """The drafter of `method` for one reply. Where it cannot be used now: plain
        decoding, saying why, or with `strict` the AcceleratorError that says how to fix it
        (the terminal, where the method was asked for by name)."""
        if not strict:
            status = self.status(method)  # loads and keeps the drafter when it is ready
            if not status.ready:
                return Resolved(Drafter(), "off",
                                [f"{status.message} This reply uses plain decoding."])
        drafter = self.drafter(method)  # says why when it decodes plainly here
        return Resolved(drafter, method, [drafter.notice] if drafter.notice else [])

    @property
    def datastore(self):
        """The model's datastore; a missing or refused one is rebuilt from the self-distilled
        answers and (unless switched off) the user's chats with it."""
        lm = self._sync()
        if self._datastore is None:
            # Opened again after a swap or a re-timing: what the last one learned is read
            # back, so its writes land first (its log's numbering then goes on from them).
            self.writer.flush()
            self._datastore = open_datastore(lm, lambda: self._datastore_sources(lm))
        return self._datastore

    def _datastore_sources(self, lm: LoadedModel) -> list[list[int]]:
        from trainer.selfdistill import data_path, load_conversations

        convs = load_conversations(data_path(lm))
        if self.store.load_settings().learn_from_chats:
            convs += list(reversed(self.store.chats_with(lm.fingerprint)))  # oldest first
        return [lm.tokenizer.encode(m["content"], add_special_tokens=False)
                for conv in convs for m in conv if isinstance(m, dict)
                and m.get("role") == "assistant" and isinstance(m.get("content"), str)
                and not text_problem(m["content"])]

    def learn(self, reply: dict, token_ids: list[int]) -> None:
        """Put a finished reply in the datastore before the next request starts (the
        rules and the switch of training on chats apply); its disk write runs after, in
        the background (StoreWriter)."""
        lm = self.host.lm
        if own_reply(reply, lm.fingerprint) and self.store.load_settings().learn_from_chats:
            pending = self.datastore.learn(token_ids)
            if pending is not None:
                self.writer.submit(store_file(lm), pending)

    def _describe(self, checkpoint: str) -> dict | None:
        """describe() of the checkpoint that loads, read again only when its folder changed
        (then the drafters that load it are dropped too)."""
        lm = self._sync()
        stamp = _stamp(checkpoint_dir(lm.fingerprint, checkpoint))
        seen = self._found.get(checkpoint)
        if seen is None or seen[0] != stamp:
            if seen is not None:
                for held in (self._drafters, self._sources):
                    for stale in [m for m in held if checkpoint in checkpoints(m)]:
                        held.pop(stale, None)
            seen = self._found[checkpoint] = (stamp, describe(lm, checkpoint))
        return seen[1]


def _stamp(own: Path) -> tuple:
    """Identity and modification time of the user's and the shipped folders of a checkpoint
    and their description files (None where missing): any save, copy or removal changes it
    (a save writes a new folder, so its inode changes even within the clock's resolution)."""
    folders = (own, shipped_root() / own.name)
    return tuple(_identity(f / name) for f in folders for name in ("", INFO, METRICS))


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_ino, found.st_mtime_ns
