"""Keeps the suite out of the user's folders: `isolate` points every folder the app (and
the libraries it drives) writes into a temporary one, `snapshot` and `changes` tell whether
the user's own folders changed anyway.

Watched: Quickdraft's platform data, cache and config folders, and the library caches a
test could reach (Hugging Face, inductor, Gradio, matplotlib), each file by size and
modification time.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import platformdirs

APP = "quickdraft"


def user_folders() -> list[Path]:
    """The real folders a run of the app could write, found before `isolate` overrides them."""
    home = Path.home()
    return [Path(platformdirs.user_data_dir(APP)), Path(platformdirs.user_cache_dir(APP)),
            Path(platformdirs.user_config_dir(APP)), home / ".cache" / "huggingface",
            home / ".config" / "matplotlib",
            Path(tempfile.gettempdir()) / f"torchinductor_{os.environ.get('USER', 'root')}",
            Path(tempfile.gettempdir()) / "gradio"]


def isolate(root: str) -> None:
    """Point the app's folders and the libraries' caches below `root` (also for the
    launcher's child processes, which inherit the environment)."""
    folders = {
        "QUICKDRAFT_DATA_DIR": "data",  # per test, conftest overrides it again
        "QUICKDRAFT_CACHE_DIR": "cache",
        "TORCHINDUCTOR_CACHE_DIR": "inductor",
        "TRITON_CACHE_DIR": "triton",
        "GRADIO_TEMP_DIR": "gradio",
        "MPLCONFIGDIR": "matplotlib",
        "HF_HOME": "huggingface",
    }
    for variable, name in folders.items():
        os.environ[variable] = str(Path(root) / name)


def snapshot(folders: list[Path] | None = None) -> dict[str, tuple[int, int]]:
    """{path: (size, mtime_ns)} of every file and folder below the watched folders."""
    seen = {}
    for folder in folders or user_folders():
        if not folder.exists():
            seen[str(folder)] = (-1, -1)  # absent: creating it is a change too
            continue
        for path in [folder, *folder.rglob("*")]:
            try:
                info = path.lstat()
            except OSError:
                continue
            seen[str(path)] = (info.st_size, info.st_mtime_ns)
    return seen


def changes(before: dict[str, tuple[int, int]]) -> list[str]:
    """What differs between `before` and the folders now, one line per path."""
    now = snapshot()
    return sorted(f"{_what(path, before, now)}: {path}" for path in before.keys() | now.keys()
                  if before.get(path) != now.get(path))


def _what(path: str, before: dict, now: dict) -> str:
    return "added" if path not in before else "removed" if path not in now else "changed"
