"""Where Quickdraft keeps its files: platformdirs, overridable for tests and packagers."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import platformdirs

APP_NAME = "quickdraft"
# What ships with the project: the bundled model, prompts, questions and accelerators.
ASSETS = Path(__file__).resolve().parent.parent / "assets"


def data_dir() -> Path:
    """Accelerators, conversations and settings (QUICKDRAFT_DATA_DIR overrides)."""
    override = os.environ.get("QUICKDRAFT_DATA_DIR")
    return Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME))


def cache_dir() -> Path:
    """Re-creatable files: the converted bundled model, feature caches (QUICKDRAFT_CACHE_DIR)."""
    override = os.environ.get("QUICKDRAFT_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir(APP_NAME))


def use_inductor_cache() -> None:
    """Point inductor's own files (the compiled steps' generated code and objects, and the
    helpers it compiles when it loads a package) into the user cache beside the packages,
    not its global folder under /tmp. Before inductor first reads its folder, which fixes
    it for the process; a folder the user set (TORCHINDUCTOR_CACHE_DIR) is kept."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Replace `path` with what `write(temporary path)` writes, so that readers see either
    the old or the new file: written beside it, flushed to disk, renamed over it. A failed
    write (a full disk) leaves the old file and no temporary one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique per writer, and hidden from readers: a half-written file is never loaded.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """Make the rename itself durable: a crash after it must not bring back the old file."""
    if os.name != "posix":
        return  # Windows has no folder handles to sync; its renames are journalled
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
