"""Conversations and settings as JSON files under the user data folder, written atomically.

    <data_dir>/settings.json
    <data_dir>/conversations/<id>.json     one file per conversation
    <data_dir>/trash/<id>.json             what Delete or Clear replaced, until Undo
    <data_dir>/exports/                    Markdown / JSON exports offered for download

Every write goes to a temporary file in the same folder, is flushed to disk, then renamed
over the old file (os.replace is atomic), so a crash mid-save leaves the previous version.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from app.conversation import Conversation, matches, title_from_prompt, unique_title
from app.datafiles import Once, atomic_write_text
from app.settings_file import Settings, SettingsFile
from app.settings_rules import CONVERSATION_ID, refuse, system_problem, text_problem
from engine.errors import QuickdraftError
from engine.paths import atomic_write, data_dir
from engine.stored_files import MIB, read_bytes, read_json

log = logging.getLogger(__name__)

EXPORT_FORMATS = ("md", "json")
TRASH_KEEP = 20  # deleted or cleared conversations kept for Undo (the newest)
EMPTY_KEEP = 10  # conversations with no message yet: New chat removes the oldest beyond it
# A conversation file larger than this is not read (skipped with one line): thousands of
# long replies fit, and the list reads every file on each page event.
CONVERSATION_BYTES = 32 * MIB


class StoreError(QuickdraftError):
    """A conversation that does not exist, or a name or format that cannot be used."""


class Store:
    """The conversation and settings files of one data folder."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else data_dir()
        self.conv_dir = self.root / "conversations"
        self.trash_dir = self.root / "trash"
        self.export_dir = self.root / "exports"
        self.settings = SettingsFile(self.root / "settings.json")
        self.settings_path = self.settings.path
        self._once = Once(log)

    # -- settings -------------------------------------------------------------------
    def load_settings(self) -> Settings:
        """The saved settings; defaults where the file or a value is missing or unusable."""
        return self.settings.load()

    def save_settings(self, settings: Settings) -> None:
        self.settings.save(settings)

    def remember(self, **changes) -> Settings:
        """Save some settings for the next launch (SettingError for a value refused)."""
        return self.settings.remember(**changes)

    # -- conversations --------------------------------------------------------------
    def list(self, query: str = "") -> list[Conversation]:
        """All readable conversations (those matching every word of `query`), newest
        first. A file that fails the reader or the conversation's checks (engine/
        stored_files.py, Conversation.from_json) is skipped, and named once per version."""
        convs = []
        for path in self.conv_dir.glob("*.json"):
            try:
                conv = self._read(path)
            except (OSError, ValueError) as exc:
                self._once.warn(path, "skipping unreadable conversation %s: %s", path.name, exc)
                continue
            if not query or matches(conv, query):
                convs.append(conv)
        return sorted(convs, key=lambda c: c.updated, reverse=True)

    def chats_with(self, fingerprint: str) -> list[list[dict]]:
        """Every stored conversation's replies by model `fingerprint` with their prompts
        (Conversation.model_turns), newest first: self-distillation data on the prompts the
        user really asks. They are read here and never leave this computer."""
        return [turns for conv in self.list() if (turns := conv.model_turns(fingerprint))]

    def get(self, conv_id: str) -> Conversation:
        path = self._path(conv_id)
        try:
            return self._read(path)
        except FileNotFoundError as exc:
            raise StoreError(f"no conversation {conv_id!r} (deleted?)") from exc
        except (OSError, ValueError) as exc:
            raise StoreError(f"conversation file {path.name} is unreadable: {exc}") from exc

    def new(self, system: str = "") -> Conversation:
        """A new, empty conversation. The oldest empty ones beyond EMPTY_KEEP go: clicks on
        New chat must not fill the disk with conversations nobody wrote in."""
        refuse("the system prompt", system_problem(system), StoreError)
        empty = [c for c in self.list() if not c.messages]
        for old in empty[EMPTY_KEEP - 1:]:
            self._path(old.id).unlink(missing_ok=True)
        now = time.time()
        conv = Conversation(uuid.uuid4().hex[:12], "New chat", now, now, system)
        self.save(conv)
        return conv

    def save(self, conv: Conversation) -> None:
        conv.updated = time.time()
        atomic_write_text(self._path(conv.id), json.dumps(asdict(conv), indent=1))

    def title_for(self, conv: Conversation, prompt: str) -> str:
        """A side-list title for `conv` from its first prompt, told apart from the titles
        of the other conversations."""
        taken = {c.title for c in self.list() if c.id != conv.id}
        return unique_title(title_from_prompt(prompt), taken)

    def rename(self, conv_id: str, title: str) -> Conversation:
        refuse("a conversation's name", text_problem(title), StoreError)
        title = " ".join(title.split())
        if not title:
            raise StoreError("a conversation needs a name")
        conv = self.get(conv_id)
        conv.title = title[:120]
        self.save(conv)
        return conv

    def set_system(self, conv_id: str, system: str) -> None:
        """The conversation's own system prompt (what its next reply is asked with)."""
        refuse("the system prompt", system_problem(system), StoreError)
        conv = self.get(conv_id)
        if conv.system != system.strip():
            conv.system = system.strip()
            self.save(conv)

    def delete(self, conv_id: str) -> None:
        """Move the conversation to the trash (`undo` brings it back)."""
        path = self._path(conv_id)
        if path.exists():
            self._to_trash(conv_id, lambda dest: os.replace(path, dest))

    def clear(self, conv_id: str) -> Conversation:
        """Forget every message of the conversation (the model will not see them again);
        the cleared version goes to the trash, for `undo`."""
        conv = self.get(conv_id)
        if not conv.messages:
            return conv
        data = read_bytes(self._path(conv_id), CONVERSATION_BYTES)  # read as get() did
        self._to_trash(conv_id, lambda dest: atomic_write(dest, lambda tmp: tmp.write_bytes(
            data)))
        conv.messages, conv.title = [], "New chat"
        self.save(conv)
        return conv

    def undo(self, conv_id: str) -> Conversation:
        """Bring back the version of a conversation that Delete or Clear replaced."""
        kept = self.trash_dir / self._path(conv_id).name
        if not kept.exists():
            raise StoreError("nothing to undo for this conversation")
        try:  # what comes back is read as every conversation is
            self._read(kept)
        except (OSError, ValueError) as exc:
            raise StoreError(f"the kept copy of this conversation is unreadable: {exc}") from exc
        self.conv_dir.mkdir(parents=True, exist_ok=True)
        os.replace(kept, self._path(conv_id))
        return self.get(conv_id)

    def _to_trash(self, conv_id: str, move) -> None:
        self.trash_dir.mkdir(parents=True, exist_ok=True)
        move(self.trash_dir / self._path(conv_id).name)
        kept = sorted(self.trash_dir.glob("*.json"), key=lambda p: p.stat().st_mtime,
                      reverse=True)
        for old in kept[TRASH_KEEP:]:
            old.unlink(missing_ok=True)

    def export(self, conv_id: str, fmt: str) -> Path:
        """Write the conversation as Markdown or JSON for download; returns the file."""
        if fmt not in EXPORT_FORMATS:
            raise StoreError(f"unknown export format {fmt!r}: choose md or json")
        conv = self.get(conv_id)
        text = conv.to_markdown() if fmt == "md" else json.dumps(asdict(conv), indent=2)
        slug = re.sub(r"[^A-Za-z0-9]+", "-", conv.title).strip("-")[:40] or "conversation"
        path = self.export_dir / f"{slug}-{conv.id}.{fmt}"
        atomic_write_text(path, text)
        return path

    def _path(self, conv_id: str) -> Path:
        if not isinstance(conv_id, str) or not CONVERSATION_ID.fullmatch(conv_id):
            raise StoreError(f"not a conversation id: {str(conv_id)[:40]!r}")
        return self.conv_dir / f"{conv_id}.json"

    @staticmethod
    def _read(path: Path) -> Conversation:
        return Conversation.from_json(read_json(path, CONVERSATION_BYTES), path.stem)
