"""Where the page's uploads (the train tab's prompts file) and Gradio's other temporary files
go, and how long they stay. Gradio's default is the system's shared temporary folder, kept
for ever; here each run of the app has its own folder in the app's cache folder
(`uploads/run-<process id>`), whose files are removed once a day old (Gradio sweeps them
while the app runs and removes its own at exit), and a start removes every folder of a run
that is no longer running (one killed never cleaned up). How many files one upload may
carry, and how much the folder may hold, is the request guard's (app/guard.py)."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import MutableMapping
from pathlib import Path

import psutil

from engine.paths import cache_dir

TEMP_ENV = "GRADIO_TEMP_DIR"  # Gradio's own setting, read when it builds the page and app
FOLDER = "uploads"  # under the cache folder
MAX_AGE_S = 24 * 3600  # long enough to start a training run with a file uploaded today
SWEEP_S = 3600  # how often the running app removes files past MAX_AGE_S
RUN_FOLDER = re.compile(r"run-(\d+)")  # one running app's folder: run-<its process id>


def use_upload_folder(environ: MutableMapping[str, str] = os.environ) -> Path:
    """Point Gradio's upload and temporary folder at this run's folder in the cache folder
    (a folder the user chose with GRADIO_TEMP_DIR is kept, and left alone), after removing
    what runs that are gone left there, and the files of running ones past MAX_AGE_S.
    Call before gradio builds the page."""
    chosen = environ.get(TEMP_ENV)
    if chosen:
        return Path(chosen)
    root = cache_dir() / FOLDER
    clean_runs(root)
    folder = root / f"run-{os.getpid()}"
    environ[TEMP_ENV] = str(folder)
    return folder


def clean_runs(root: Path) -> None:
    """Remove from `root` every entry but the folders of running apps (whose files past
    MAX_AGE_S go): a process killed before its exit handlers ran leaves its uploads."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        match = RUN_FOLDER.fullmatch(entry.name)
        running = match is not None and entry.is_dir() and not entry.is_symlink() and \
            int(match[1]) != os.getpid() and psutil.pid_exists(int(match[1]))
        try:
            if running:
                remove_old(entry, MAX_AGE_S)
            elif entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue  # in use or gone: the next start tries again


def remove_old(folder: Path, age_s: float) -> None:
    """Remove the files in `folder` (one level of subfolders, as Gradio stores them) not
    changed for `age_s` seconds, and the subfolders left empty. Another app running on the
    same cache folder keeps its recent files."""
    if not folder.is_dir():
        return
    cutoff = time.time() - age_s
    for entry in folder.iterdir():
        try:
            if entry.is_dir() and not entry.is_symlink():
                for file in entry.iterdir():
                    _remove_if_old(file, cutoff)
                if not any(entry.iterdir()):
                    entry.rmdir()
            else:
                _remove_if_old(entry, cutoff)
        except OSError:
            continue  # in use or gone: the next start tries again


def _remove_if_old(path: Path, cutoff: float) -> None:
    if path.lstat().st_mtime >= cutoff:
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
