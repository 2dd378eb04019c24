"""What the app remembers between launches, in <data_dir>/settings.json.

The file is read with every setting checked (app.settings_rules): a wrong value costs only
that setting. Writing it keeps what this version does not know (a newer version's keys), and
before a file with refused values or no readable JSON is replaced, a copy of it is kept
beside it as settings.json.bad-<time>: what a person wrote by hand is never silently lost.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from app.datafiles import Once, atomic_write_text
from app.settings_rules import problem, refuse
from engine.paths import atomic_write
from engine.stored_files import MIB, read_bytes, read_json

SETTINGS_BYTES = MIB  # a settings file larger than this is not read (defaults, one line)

log = logging.getLogger(__name__)


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
    acceptance: str = "auto"  # drafts met with the lossless rule, or "typical" (faster)
    system: str = ""  # system prompt for new conversations
    last_conversation: str = ""  # id of the conversation open when the app was left
    # Learn from my chats: the datastore learns each finished reply and is built from the
    # stored chats with the model (the Train tab's checkbox starts from it)
    learn_from_chats: bool = True

    @classmethod
    def checked(cls, data: dict) -> tuple[Settings, list[str]]:
        """Saved values over the defaults, and one line per value refused (wrong type or
        out of its range: that setting keeps its default)."""
        values = asdict(cls())
        refused = []
        for key, default in list(values.items()):
            if key not in data:
                continue
            value = _coerce(data[key], default)
            why = "wrong type" if value is None else problem(key, value)
            if why is None:
                values[key] = value
            else:
                refused.append(f"ignoring {key} = {repr(data[key])[:60]} ({why}); "
                               f"using {default!r}")
        return cls(**values), refused


def _coerce(value, default):
    """`value` as the type of `default`, or None when it is of another type."""
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value if type(value) is type(default) else None


class SettingsFile:
    """settings.json of one data folder."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()  # one read-modify-write at a time
        self._once = Once(log)

    def load(self) -> Settings:
        """The saved settings; defaults for a missing or unreadable file or value."""
        return self._read()[0]

    def save(self, settings: Settings) -> None:
        """Write `settings` (keys of a newer version stay)."""
        with self._lock:
            _saved, raw, keep = self._read()
            self._write(raw, keep, settings)

    def remember(self, **changes) -> Settings:
        """Save some settings for the next launch. SettingError (one line) for a value the
        setting cannot take: it is neither saved nor used."""
        for key, value in changes.items():
            default = getattr(Settings(), key)  # AttributeError: a caller's typo
            refuse(key, "has the wrong type" if _coerce(value, default) is None
                   else problem(key, value))
        with self._lock:
            settings, raw, keep = self._read()
            settings = replace(settings, **{k: _coerce(v, getattr(settings, k))
                                            for k, v in changes.items()})
            self._write(raw, keep, settings)
        return settings

    def _read(self) -> tuple[Settings, dict, bool]:
        """(settings, the file's keys to write back beside them, whether the file must be
        kept before it is replaced: no JSON object, or values refused, when only the keys
        this version does not know are written back)."""
        try:
            data = read_json(self.path, SETTINGS_BYTES)
        except FileNotFoundError:
            return Settings(), {}, False
        except (OSError, ValueError) as exc:
            self._once.warn(self.path, "ignoring unreadable settings file %s: %s", self.path, exc)
            return Settings(), {}, True
        if not isinstance(data, dict):
            self._once.warn(self.path, "ignoring settings file %s: not a JSON object", self.path)
            return Settings(), {}, True
        settings, refused = Settings.checked(data)
        for line in refused:
            self._once.warn(self.path, "%s: %s", self.path, line)
        if refused:
            known = asdict(settings)
            return settings, {k: v for k, v in data.items() if k not in known}, True
        return settings, data, False

    def _write(self, raw: dict, keep: bool, settings: Settings) -> None:
        """Write the file; a write the disk refuses (full, read-only, a folder in the file's
        place) is said in one line and costs only the remembering: the page goes on."""
        if keep:  # keep what is about to be replaced
            self._keep_copy()
        try:
            atomic_write_text(self.path, json.dumps({**raw, **asdict(settings)}, indent=2))
        except OSError as exc:
            self._once.warn(self.path, "could not save the settings to %s: %s", self.path,
                            exc.strerror or exc)

    def _keep_copy(self) -> None:
        stamp = f"{self.path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}"
        copy, n = self.path.with_name(stamp), 1
        while copy.exists():  # two in one second: both are kept
            n += 1
            copy = self.path.with_name(f"{stamp}-{n}")
        try:
            data = read_bytes(self.path, SETTINGS_BYTES)
            atomic_write(copy, lambda tmp: tmp.write_bytes(data))
        except (OSError, ValueError) as exc:
            self._once.warn(self.path, "could not keep a copy of %s: %s", self.path, exc)
            return
        log.warning("%s had values that could not be used: kept as %s", self.path.name,
                    copy.name)
