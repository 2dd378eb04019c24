"""Conversations and settings as JSON files under the user data folder, written atomically.

    <data_dir>/settings.json
    <data_dir>/conversations/<id>.json     one file per conversation
    <data_dir>/exports/                    Markdown / JSON exports offered for download

Every write goes to a temporary file in the same folder, is flushed to disk, then renamed
over the old file (os.replace is atomic), so a crash mid-save leaves the previous version.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from app.settings_rules import CONVERSATION_ID, problem
from engine.errors import QuickdraftError
from engine.paths import atomic_write, data_dir

log = logging.getLogger(__name__)

TITLE_CHARS = 48  # a new conversation is titled after its first prompt, cut to this length
EXPORT_FORMATS = ("md", "json")


class StoreError(QuickdraftError):
    """A conversation that does not exist, or a name or format that cannot be used."""


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that readers see either the old or the new file."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic_write(path, write)


@dataclass
class Conversation:
    """One chat: what the side list shows and what the model is asked to continue."""

    id: str  # file name stem (hex)
    title: str  # side-list label: the first prompt, until the user renames it
    created: float  # unix time
    updated: float  # unix time of the last change; the list shows the newest first
    system: str = ""  # system prompt of this chat ("" = the model's own default)
    # {"role": "user" | "assistant", "content": str}; replies also keep "stats" (the
    # engine's stats JSON), "accel" (the method that produced them), "model" (the
    # fingerprint of the model that wrote them) and "acceptance" (the rule drafts met)
    messages: list[dict] = field(default_factory=list)

    def turns(self) -> list[dict]:
        """The messages as plain {"role", "content"} dicts (chat template, Chatbot)."""
        return [{"role": m["role"], "content": m["content"]} for m in self.messages]

    def model_turns(self, fingerprint: str) -> list[dict]:
        """The conversation as {"role", "content"} messages (the system prompt first) up to
        its last reply that model `fingerprint` wrote itself, for training its accelerator;
        [] when it has none. It stops before the first reply that is not such a reply:
        what follows was conditioned on it."""
        turns = [{"role": "system", "content": self.system}] if self.system else []
        kept = []
        for m in self.messages:
            if m["role"] == "assistant" and not own_reply(m, fingerprint):
                break
            turns.append({"role": m["role"], "content": m["content"]})
            if m["role"] == "assistant":
                kept = list(turns)
        return kept

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        if self.system:
            lines += [f"*System:* {self.system}", ""]
        for m in self.messages:
            who = "**You**" if m["role"] == "user" else "**Assistant**"
            lines += [who, "", str(m["content"]), ""]
        return "\n".join(lines)

    @classmethod
    def from_json(cls, data, conv_id: str) -> Conversation:
        """A conversation from its file's JSON (`conv_id`: the file's name, which wins over the
        id inside); ValueError saying what is wrong with a file of another shape."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, found {type(data).__name__}")
        if not CONVERSATION_ID.fullmatch(conv_id):
            raise ValueError(f"not a conversation id: {conv_id!r}")
        for key, kind in (("title", str), ("system", str), ("messages", list)):
            if key in data and not isinstance(data[key], kind):
                raise ValueError(f"{key} must be a {kind.__name__}")
        for key in ("created", "updated"):
            if not _is_time(data.get(key)):
                raise ValueError(f"{key} must be a time in seconds")
        messages = [_message(m, i) for i, m in enumerate(data.get("messages", []))]
        return cls(conv_id, data.get("title", "Untitled"), float(data["created"]),
                   float(data["updated"]), data.get("system", ""), messages)


def _is_time(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _message(m, i: int) -> dict:
    """A stored message checked: a user or assistant turn; content that is not text (a
    hand-edited file) is kept as its JSON text rather than hiding the conversation."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise ValueError(f"messages[{i}] must be an object with role user or assistant")
    content = m.get("content")
    if not isinstance(content, str):
        content = "" if content is None else json.dumps(content)
    return {**m, "content": content}


def own_reply(message: dict, fingerprint: str) -> bool:
    """A reply the model `fingerprint` generated in full (plain or drafted decoding, greedy
    or sampled): not empty, not stopped part-way (a stopped or interrupted reply has no
    "stats" or stop reason "cancelled"), and not drafted with typical acceptance, which
    keeps draft tokens the model might not have chosen. Replies saved before the model was
    recorded cannot be attributed and are never used."""
    stats = message.get("stats")
    typical = message.get("acceptance") == "typical" and message.get("accel") != "off"
    return (message.get("model") == fingerprint and bool(str(message["content"]).strip())
            and isinstance(stats, dict) and stats.get("stop_reason") != "cancelled"
            and not typical)


@dataclass
class Settings:
    """What the app remembers between launches."""

    model: str = "default"  # last model loaded: "default", a folder or a repo id
    quant: str = "auto"  # its quantization choice (never whether it may run its own code)
    accel: str = "auto"  # last acceleration method chosen (Auto until one is picked)
    temperature: float = 0.2  # sampling defaults (SmolLM2's recommended settings)
    top_p: float = 0.9  # nucleus sampling mass
    top_k: int = 0  # 0 = no top-k limit
    max_new_tokens: int = 512  # reply length cap
    system: str = ""  # system prompt for new conversations
    last_conversation: str = ""  # id of the conversation open when the app was left
    # Learn from my chats: the datastore learns each finished reply and is built from the
    # stored chats with the model (the Train tab's checkbox starts from it)
    learn_from_chats: bool = True

    @classmethod
    def from_json(cls, data: dict, source: str) -> Settings:
        """Saved values over the defaults; a value of the wrong type or out of its range
        keeps its default, with one line naming `source` and the key (a hand-edited or
        older file must not break the app)."""
        values = asdict(cls())
        for key, default in list(values.items()):
            if key not in data:
                continue
            value = _coerce(data[key], default)
            why = "wrong type" if value is None else problem(key, value)
            if why is None:
                values[key] = value
            else:
                log.warning("%s: ignoring %s = %s (%s); using %r", source, key,
                            repr(data[key])[:60], why, default)
        return cls(**values)


def _coerce(value, default):
    """`value` as the type of `default`, or None when it is of another type."""
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value if type(value) is type(default) else None


class Store:
    """The conversation and settings files of one data folder."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else data_dir()
        self.conv_dir = self.root / "conversations"
        self.settings_path = self.root / "settings.json"
        self._settings_lock = threading.Lock()  # read-modify-write of the settings file
        self.export_dir = self.root / "exports"

    # -- settings -------------------------------------------------------------------
    def load_settings(self) -> Settings:
        """The saved settings; defaults when the file is missing or unreadable."""
        try:
            data = json.loads(self.settings_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return Settings()
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable settings file %s: %s", self.settings_path, exc)
            return Settings()
        if not isinstance(data, dict):
            log.warning("ignoring settings file %s: not a JSON object", self.settings_path)
            return Settings()
        return Settings.from_json(data, str(self.settings_path))

    def save_settings(self, settings: Settings) -> None:
        atomic_write_text(self.settings_path, json.dumps(asdict(settings), indent=2))

    def remember(self, **changes) -> Settings:
        """Save some settings for the next launch (one read-modify-write at a time)."""
        with self._settings_lock:
            settings = replace(self.load_settings(), **changes)
            self.save_settings(settings)
        return settings

    # -- conversations --------------------------------------------------------------
    def list(self) -> list[Conversation]:
        """All readable conversations, newest first (unreadable files are skipped)."""
        convs = []
        for path in self.conv_dir.glob("*.json"):
            try:
                convs.append(self._read(path))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("skipping unreadable conversation %s: %s", path.name, exc)
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
        except (OSError, ValueError, TypeError) as exc:
            raise StoreError(f"conversation file {path} is unreadable: {exc}") from exc

    def new(self, system: str = "") -> Conversation:
        now = time.time()
        conv = Conversation(uuid.uuid4().hex[:12], "New chat", now, now, system)
        self.save(conv)
        return conv

    def save(self, conv: Conversation) -> None:
        conv.updated = time.time()
        atomic_write_text(self._path(conv.id), json.dumps(asdict(conv), indent=1))

    def rename(self, conv_id: str, title: str) -> Conversation:
        title = " ".join(title.split())
        if not title:
            raise StoreError("a conversation needs a name")
        conv = self.get(conv_id)
        conv.title = title[:120]
        self.save(conv)
        return conv

    def delete(self, conv_id: str) -> None:
        self._path(conv_id).unlink(missing_ok=True)

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
        if not CONVERSATION_ID.fullmatch(conv_id or ""):
            raise StoreError(f"not a conversation id: {conv_id!r}")
        return self.conv_dir / f"{conv_id}.json"

    @staticmethod
    def _read(path: Path) -> Conversation:
        return Conversation.from_json(json.loads(path.read_text(encoding="utf-8")), path.stem)


def title_from_prompt(prompt: str) -> str:
    """A side-list title from the first prompt: its first line, cut at a word."""
    line = " ".join(prompt.split())
    if len(line) <= TITLE_CHARS:
        return line or "New chat"
    return line[:TITLE_CHARS].rsplit(" ", 1)[0] + "…"
