"""The accelerators of the loaded model: whether each method can be used now, its ready
drafter, and the datastore of the model's own replies. What is stored on disk is read again
only when a checkpoint's folder changes (training saved one, or one was copied in); the
drafters that load it are rebuilt then."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from app.conversation import own_reply
from app.host import ModelHost, model_name
from app.store import Store
from engine.accelerators import (
    INFO,
    METRICS,
    checkpoint_dir,
    describe,
    is_shipped,
    measured_speedup,
    shipped_root,
)
from engine.drafters.base import Drafter
from engine.drafters.datastore import open_datastore, store_file
from engine.drafters.registry import (
    ACCEL_CHOICES,
    ACCEL_LABELS,
    TRAINED,
    base_method,
    checkpoints,
    load_drafter,
    over_datastore,
)
from engine.errors import AcceleratorError, QuickdraftError
from engine.loading import LoadedModel


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


class Accelerators:
    """Ready drafters, stored descriptions and the datastore for the host's model, kept until
    it changes."""

    def __init__(self, store: Store, host: ModelHost):
        self.store = store
        self.host = host
        self._drafters: dict[str, Drafter] = {}  # ready drafters for host.lm, by method
        self._found: dict[str, tuple] = {}  # checkpoint -> (folder stamp, describe())
        self._datastore = None  # the datastore of host.lm's own outputs, once opened
        host.on_swap.append(self.forget)

    def forget(self) -> None:
        """Drop everything built for the model (it is being swapped)."""
        self._drafters, self._found, self._datastore = {}, {}, None

    def status(self, method: str) -> AccelStatus:
        """Can `method` be used now? Loads (and keeps) its drafter when it can."""
        label = accel_label(method)
        if method == "off":
            return AccelStatus(method, True, False, "Plain decoding: one token per model step.")
        if method not in ACCEL_CHOICES:
            raise QuickdraftError(f"unknown acceleration {method!r}")
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
        return AccelStatus(method, True, False, _ready_line(label, info, drafter.pays))

    def _auto_status(self) -> AccelStatus:
        auto = self.drafter("auto")
        untrained = not any(self._describe(m) for m in TRAINED)
        hint = " Train an accelerator to give it more to choose from." if untrained else ""
        return AccelStatus("auto", True, False, f"{auto.reason()}.{hint}")

    def drafter(self, method: str) -> Drafter:
        """The ready drafter of `method` (AcceleratorError when it cannot be built)."""
        if method == "off":
            return Drafter()
        for checkpoint in checkpoints(method):
            self._describe(checkpoint)  # drops drafters whose checkpoint changed
        if method == "datastore" and method not in self._drafters:
            self._drafters[method] = over_datastore(self.datastore, self.host.lm)
        if method not in self._drafters:
            # Composed methods share the drafters held here.
            self._drafters[method] = load_drafter(self.host.lm, method,
                                                  lambda _lm, m: self.drafter(m))
        return self._drafters[method]

    def drafter_or_off(self, method: str) -> tuple[Drafter, str, list[str]]:
        """(drafter, method, notices): plain decoding, saying why, where `method` cannot
        be used now."""
        status = self.status(method)
        if status.ready:
            drafter = self.drafter(method)  # says why when it decodes plainly here
            return drafter, method, [drafter.notice] if drafter.notice else []
        return Drafter(), "off", [f"{status.message} This reply uses plain decoding."]

    @property
    def datastore(self):
        """The model's datastore; a missing or refused one is rebuilt from the self-distilled
        answers and (unless switched off) the user's chats with it."""
        if self._datastore is None:
            lm = self.host.lm
            self._datastore = open_datastore(lm, lambda: self._datastore_sources(lm))
        return self._datastore

    def _datastore_sources(self, lm: LoadedModel) -> list[list[int]]:
        from trainer.selfdistill import data_path, load_conversations

        convs = load_conversations(data_path(lm))
        if self.store.load_settings().learn_from_chats:
            convs += list(reversed(self.store.chats_with(lm.fingerprint)))  # oldest first
        return [lm.tokenizer.encode(m["content"], add_special_tokens=False)
                for conv in convs for m in conv if m["role"] == "assistant"]

    def learn(self, reply: dict, token_ids: list[int]) -> None:
        """Put a finished reply in the datastore before the next request starts (the
        rules and the switch of training on chats apply)."""
        lm = self.host.lm
        if own_reply(reply, lm.fingerprint) and self.store.load_settings().learn_from_chats:
            store = self.datastore
            store.add(token_ids)
            store.save(store_file(lm))

    def _describe(self, checkpoint: str) -> dict | None:
        """describe() of the checkpoint that loads, read again only when its folder changed
        (then the drafters that load it are dropped too)."""
        lm = self.host.lm
        stamp = _stamp(checkpoint_dir(lm.fingerprint, checkpoint))
        seen = self._found.get(checkpoint)
        if seen is None or seen[0] != stamp:
            if seen is not None:
                for stale in [m for m in self._drafters if checkpoint in checkpoints(m)]:
                    self._drafters.pop(stale, None)
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


def _ready_line(label: str, info: dict, pays: bool) -> str:
    """Status of a trained accelerator from its description (speedup measured here) and
    whether its drafter pays here (Drafter.pays: calibration's verdict, or the re-timed
    one in another dtype or on another device)."""
    metrics = info.get("metrics", {})
    line = f"{label} is ready."
    speedup = measured_speedup(metrics)
    if speedup is not None:
        shipped = "folder" in info and is_shipped(info["folder"])
        where = "on the machine it was built on" if shipped else "when it was trained"
        line += f" Measured {speedup:.2f}× over plain decoding {where}."
    if not pays:
        line += " It did not beat plain decoding on this machine: Off may be faster."
    return line
