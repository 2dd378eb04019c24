"""The datastore on disk: a snapshot plus a log of the replies learned since. Replayed at
load it gives the store as it was in memory; a kill -9 in the middle of a write (of a log
record, or of a snapshot) loses nothing but the reply being written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from engine.datastore.disk import log_path, persist
from engine.datastore.load import load, open_store
from engine.datastore.memory import Datastore
from engine.datastore.params import DatastoreParams
from tests.paths import ROOT

# A small recent tier: every few replies the index is rebuilt and a snapshot is due.
SMALL = DatastoreParams(recent_cap=40)


def _doc(i: int) -> list[int]:
    """The i-th reply: ten tokens no other reply has."""
    return [1000 * (i + 1) + k for k in range(10)]


def _docs(store: Datastore) -> list[list[int]]:
    return [d.tolist() for d in store.docs]


def _learned(path: Path, count: int) -> Datastore:
    """A store saved at `path` that then learned `count` replies, each persisted."""
    store = Datastore("fp", SMALL)
    store.save(path)
    for i in range(count):
        persist(path, store.learn(_doc(i)))
    return store


def test_the_log_replays_to_the_store_in_memory(tmp_path):
    path = tmp_path / "store.safetensors"
    store = Datastore("fp", SMALL)
    store.save(path)
    snapshots = []
    for i in range(9):
        pending = store.learn(_doc(i))
        snapshots += [i] if pending.snapshot is not None else []
        persist(path, pending)
    assert snapshots == [4]  # most replies only append a record; a rebuild snapshots
    assert log_path(path).is_file()  # the four replies since
    store.learn(_doc(9))  # learned, never persisted (killed before its write)
    again = load(path, "fp", SMALL)
    assert _docs(again) == _docs(store)[:9]
    assert again.serial == 9 and again.continuations([1000, 1001]).tokens[:2] == [1002, 1003]


def test_a_snapshot_ends_the_log_and_a_kill_before_its_removal_replays_nothing_twice(tmp_path):
    path = tmp_path / "store.safetensors"
    store = _learned(path, 3)
    kept = log_path(path).read_bytes()  # as a kill right after the snapshot's rename leaves it
    store.save(path)
    assert not log_path(path).exists()
    log_path(path).write_bytes(kept)
    assert _docs(load(path, "fp", SMALL)) == [_doc(i) for i in range(3)]


def test_a_log_of_a_rebuilt_store_is_never_replayed_into_the_new_one(tmp_path):
    path = tmp_path / "store.safetensors"
    _learned(path, 2)
    old_log = log_path(path).read_bytes()
    rebuilt = open_store(path, "other-model", lambda: [[7, 8, 9]])  # refused: rebuilt
    log_path(path).write_bytes(old_log)  # a kill between its snapshot and the log's removal
    assert _docs(load(path, "other-model")) == _docs(rebuilt) == [[7, 8, 9]]


# A child process that learns `count` replies, each persisted, then stalls part-way through
# writing the next one (its log record, or the snapshot after it) and says so.
CHILD = """
import sys, time
from pathlib import Path
import engine.datastore.disk as ds
from tests.engine.datastore.test_datastore_log import _learned, _doc

path, count, where = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

def stall():
    print("stalled", flush=True)
    time.sleep(600)

def half_record(f, data):
    f.write(data[: len(data) // 2])
    f.flush()
    stall()

def half_snapshot(arrays, filename, metadata=None):
    Path(filename).write_bytes(b"\\0" * 64)
    stall()

store = _learned(path, count)
if where == "record":
    ds.write_record = half_record
else:
    ds.save_file = half_snapshot
pending = store.learn(_doc(count))
assert (pending.snapshot is not None) == (where == "snapshot")
ds.persist(path, pending)
"""


def _killed_while_writing(path: Path, count: int, where: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(count), where],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "stalled"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL


def test_a_kill_during_a_log_record_loses_only_that_reply(tmp_path):
    path = tmp_path / "store.safetensors"
    _killed_while_writing(path, 5, "record")  # the 6th reply's record: no rebuild due
    store = load(path, "fp", SMALL)
    assert _docs(store) == [_doc(i) for i in range(5)]
    persist(path, store.learn(_doc(42)))  # the torn record is cut off, not built upon
    assert _docs(load(path, "fp", SMALL)) == [*(_doc(i) for i in range(5)), _doc(42)]


def test_a_kill_during_a_snapshot_loses_nothing(tmp_path):
    path = tmp_path / "store.safetensors"
    _killed_while_writing(path, 4, "snapshot")  # the 5th reply rebuilds the index
    leftovers = {p.name for p in tmp_path.iterdir()} - {path.name, log_path(path).name}
    assert all(name.endswith(".tmp") for name in leftovers)  # the half-written snapshot
    store = load(path, "fp", SMALL)
    assert _docs(store) == [_doc(i) for i in range(5)]  # its record was written first
