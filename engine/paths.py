"""Where Quickdraft keeps its files: platformdirs, overridable for tests and packagers."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "quickdraft"


def data_dir() -> Path:
    """Accelerators, conversations and settings (QUICKDRAFT_DATA_DIR overrides)."""
    override = os.environ.get("QUICKDRAFT_DATA_DIR")
    return Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME))


def cache_dir() -> Path:
    """Re-creatable files: the converted bundled model, feature caches (QUICKDRAFT_CACHE_DIR)."""
    override = os.environ.get("QUICKDRAFT_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir(APP_NAME))
