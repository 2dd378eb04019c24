"""Opening the datastore (engine/datastore/memory.py) from its files (engine/datastore/disk.py):
the snapshot read and checked, the log of the replies learned since replayed over it, and a
missing, corrupt, foreign or outdated store rebuilt from the sources the caller names (a
refused file is reported in one log line). No pickle anywhere."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file

from engine.datastore.disk import FORMAT_VERSION, KIND, log_path, new_lineage, read_log
from engine.datastore.memory import Datastore, joined
from engine.datastore.params import DatastoreParams
from engine.datastore.suffix_index import SuffixIndex
from engine.stored_files import check_regular, read_bytes

STORE_BYTES = 8 * 2**30  # a snapshot larger than this is refused (rebuilt)
LOG_BYTES = 2**30  # the log of replies since the snapshot (a snapshot is due long before)

log = logging.getLogger(__name__)


def load(path: Path, fingerprint: str, params: DatastoreParams | None = None) -> Datastore:
    """The store at `path` with its log replayed; ValueError (one line) for a corrupt,
    foreign or newer snapshot."""
    store = _load_snapshot(path, fingerprint, params)
    _replay(store, path)
    return store


def open_store(path: Path, fingerprint: str, sources: Callable[[], Iterable[list[int]]] | None,
               params: DatastoreParams | None = None,
               fallback: Path | None = None) -> Datastore:
    """The store at `path`; if it is missing, corrupt, foreign, or started from another
    version of the `fallback` file (the shipped one): that file, else a new store, with the
    documents of `sources` (oldest first) added and saved. A user's store is thereby rebuilt
    from the newer shipped store and the sources it was learned from (their chats and
    training answers), so an update's bigger store reaches them. A refused file is reported
    in one log line."""
    seed = _file_hash(fallback) if fallback is not None else ""
    store = _load_logged(path, fingerprint, params)
    if store is not None and (store.seed == seed or sources is None):  # None: cannot rebuild
        return store
    base = _load_logged(fallback, fingerprint, params) if seed else None
    store = base or Datastore(fingerprint, params)
    store.seed = seed if base else ""
    store.lineage = new_lineage()  # rebuilt: the old log (its documents are in the sources) ends
    if sources is None:
        return store
    docs = list(sources())
    if docs or base is None:
        store.add_all(docs)
    try:
        store.save(path)  # the new lineage is on disk before any record of it is logged
    except OSError as exc:  # a full disk, a folder in its place: it serves from memory
        log.warning("the datastore could not be saved to %s: %s", path, exc.strerror or exc)
    return store


def _replay(store: Datastore, path: Path) -> None:
    """Learn the log's records that came after the snapshot, in their order."""
    log_file = log_path(path)
    try:
        data = read_bytes(log_file, LOG_BYTES)
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:  # the next append replaces it (append_record)
        log.warning("datastore log %s not read: %s", log_file, exc)
        return
    _end, records = read_log(data, store.lineage)
    for serial, tokens in records:
        if serial > store.serial:
            store.add(tokens)
            store.serial = serial


def _load_snapshot(path: Path, fingerprint: str,
                   params: DatastoreParams | None = None) -> Datastore:
    try:
        check_regular(path, STORE_BYTES)  # safetensors opens the path itself
        with safe_open(str(path), framework="numpy") as fh:
            meta = fh.metadata() or {}
        arrays = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"unreadable datastore {path}: {exc}") from None
    if meta.get("kind") != KIND or meta.get("version") != str(FORMAT_VERSION):
        raise ValueError(f"{path} is not a version-{FORMAT_VERSION} datastore")
    if meta.get("fingerprint") != fingerprint:
        raise ValueError(f"{path} was built for another model")
    tokens, lengths = arrays.get("tokens"), arrays.get("lengths")
    if tokens is None or lengths is None or int(lengths.sum()) != len(tokens):
        raise ValueError(f"{path} is corrupt: its documents do not add up")
    store = Datastore(fingerprint, params)
    store.docs = np.split(tokens.astype(np.int32), np.cumsum(lengths)[:-1]) if len(lengths) else []
    store.main_docs = int(meta.get("main_docs", 0))
    store.seed = meta.get("seed", "")
    store.lineage = meta.get("lineage") or store.lineage  # older files: a log of none
    store.serial = int(meta.get("serial", 0))
    main = joined(store.docs[: store.main_docs])
    sa = arrays.get("main_sa")
    if sa is None or len(sa) != len(main) or (len(sa) and (sa.min() < 0 or sa.max() >= len(main))):
        raise ValueError(f"{path} is corrupt: its index does not fit its tokens")
    store.main = SuffixIndex(main, sa)
    store.recent = SuffixIndex(joined(store.docs[store.main_docs:]))
    return store


def _load_logged(path: Path | None, fingerprint: str,
                 params: DatastoreParams | None) -> Datastore | None:
    if path is None or not Path(path).is_file():
        return None
    try:
        return load(path, fingerprint, params)
    except ValueError as exc:
        log.warning("datastore refused, rebuilding it: %s", exc)
        return None


def _file_hash(path: Path) -> str:
    """The shipped store's identity; "" when there is none that reads."""
    try:
        return hashlib.sha256(read_bytes(Path(path), STORE_BYTES)).hexdigest()[:16]
    except (OSError, ValueError):
        return ""
