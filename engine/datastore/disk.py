"""The datastore's files (engine/datastore/memory.py): a snapshot and the log of what was learned
since, written without the store itself (what to write is captured first: Snapshot,
Pending), so a background writer can write while the store learns on.

- Snapshot: one safetensors file (token array, document lengths, main's suffix array) whose
  header holds the format version, the model fingerprint, the store's lineage and how many
  documents it had learned (its serial); written to a temporary file and renamed.
- Log: `store.log` beside it, a header naming the lineage, then one record per learned
  document (serial, token count, crc32, int32 tokens), appended and flushed to disk. Load
  replays the records whose serial is above the snapshot's; a torn record (a kill
  mid-write) ends the log and is cut off before the next append.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from engine.paths import atomic_write, sync_folder

FORMAT_VERSION = 1
KIND = "quickdraft-datastore"
LOG_MAGIC = b"quickdraft-datastore-log 1 "  # + the lineage + newline
RECORD = struct.Struct("<qII")  # serial, token count, crc32 of the serial/count and tokens


@dataclass(frozen=True)
class Snapshot:
    """A store's documents and main index as they were at one moment (Datastore.snapshot)."""

    fingerprint: str
    params: dict  # DatastoreParams' fields
    seed: str
    lineage: str
    serial: int  # documents learned up to it: later log records are replayed over it
    docs: tuple[np.ndarray, ...]
    main_docs: int
    main_sa: np.ndarray


@dataclass(frozen=True)
class Pending:
    """What one learned document needs on disk (Datastore.learn -> persist)."""

    lineage: str
    serial: int
    tokens: np.ndarray  # int32
    snapshot: Snapshot | None  # the whole store, when learning it rebuilt the main index


def new_lineage() -> str:
    return uuid.uuid4().hex[:16]


def log_path(path: Path) -> Path:
    """The log of documents learned since the snapshot at `path`."""
    return Path(path).with_suffix(".log")


def persist(path: Path, pending: Pending) -> None:
    """Put a learned document on disk: its log record first (a kill during the snapshot
    then still finds it there), then the snapshot when one is due. Calls must run in the
    order the documents were learned (one writer): the snapshot ends the log."""
    append_record(path, pending.lineage, pending.serial, pending.tokens)
    if pending.snapshot is not None:
        write_snapshot(Path(path), pending.snapshot)


def write_snapshot(path: Path, snap: Snapshot) -> None:
    """The snapshot, atomically; then its log is removed (every record in it is in the
    snapshot). A kill between the two leaves records the snapshot's serial skips."""
    lengths = np.array([len(d) for d in snap.docs], np.int64)
    meta = {"kind": KIND, "version": str(FORMAT_VERSION), "fingerprint": snap.fingerprint,
            "main_docs": str(snap.main_docs), "params": json.dumps(snap.params),
            "seed": snap.seed, "lineage": snap.lineage, "serial": str(snap.serial)}
    tokens = np.concatenate(snap.docs).astype(np.int32) if snap.docs else np.zeros(0, np.int32)
    arrays = {"tokens": tokens, "lengths": lengths,
              "main_sa": snap.main_sa}
    atomic_write(path, lambda tmp: save_file(arrays, str(tmp), metadata=meta))
    log_path(path).unlink(missing_ok=True)


def append_record(path: Path, lineage: str, serial: int, tokens: np.ndarray) -> None:
    """Append one document to the log of the snapshot at `path`, flushed to disk. A torn
    record left by a kill is cut off first, and a log of another lineage replaced, so the
    new record is always readable after the ones before it."""
    log = log_path(path)
    log.parent.mkdir(parents=True, exist_ok=True)
    if log.is_symlink() or (log.exists() and not log.is_file()):
        # a link, a FIFO or a folder put in its place: never opened (it could block)
        shutil.rmtree(log) if log.is_dir() and not log.is_symlink() else log.unlink()
    created = not log.exists()
    with open(log, "a+b") as f:
        f.seek(0)
        end, _records = read_log(f.read(), lineage)
        f.truncate(end)
        if end == 0:
            f.write(LOG_MAGIC + lineage.encode() + b"\n")
        body = np.asarray(tokens, np.int32).astype("<i4").tobytes()
        head = struct.pack("<qI", serial, len(tokens))
        write_record(f, RECORD.pack(serial, len(tokens), zlib.crc32(head + body)) + body)
        f.flush()
        os.fsync(f.fileno())
    if created:
        sync_folder(log.parent)


def write_record(f, data: bytes) -> None:
    """One record's bytes into the log (a seam where tests stop a write part-way)."""
    f.write(data)


def read_log(data: bytes, lineage: str) -> tuple[int, list[tuple[int, np.ndarray]]]:
    """(bytes of the log that are whole and of `lineage`, its (serial, tokens) records).
    0 when the header is torn or names another lineage: none of it belongs to the store."""
    header = LOG_MAGIC + lineage.encode() + b"\n"
    if not data.startswith(header):
        return 0, []
    end, records = len(header), []
    while end + RECORD.size <= len(data):
        serial, count, crc = RECORD.unpack_from(data, end)
        body = data[end + RECORD.size:end + RECORD.size + 4 * count]
        if len(body) < 4 * count or zlib.crc32(struct.pack("<qI", serial, count) + body) != crc:
            break  # torn by a kill mid-write: it and anything after it never completed
        records.append((serial, np.frombuffer(body, "<i4").astype(np.int32)))
        end += RECORD.size + 4 * count
    return end, records
