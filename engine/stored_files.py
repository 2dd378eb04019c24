"""The one way Quickdraft reads a file it stored (conversations, settings, the trash,
accelerators' descriptions and weights, the datastore and its log, uploaded prompt files):
a regular file only, under a size cap, never blocking, its text valid UTF-8, its JSON
nested no deeper than a limit and free of lone surrogates. Anything else is a
StoredFileError (one line) that the caller turns into a skipped file or a clear error.

Why each rule: a FIFO or a device given a stored file's name blocks a plain open() for ever
(a reply waiting on it holds the model); a symbolic link points the app at a file it never
wrote; a deeply nested JSON array exhausts the parser's recursion; a "\\ud800" escape parses
to text that no page, tokenizer or UTF-8 file takes.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path

MIB = 2**20
JSON_DEPTH = 64  # nesting the app's own JSON files never come near (a conversation: ~5)
# Opening a FIFO for reading blocks until a writer appears; non-blocking, the open returns at
# once and fstat tells it apart. O_NOFOLLOW refuses a link in the last part of the path.
# (Neither flag exists on Windows, where the lstat check below stands in for them.)
_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) \
    | getattr(os, "O_BINARY", 0)
# A JSON string (the unrolled form of "(?:[^"\\]|\\.)*", linear on long strings).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE = re.compile("[\ud800-\udfff]")


class StoredFileError(ValueError):
    """A stored file that is not read as it stands (why, in one line)."""


def check_regular(path: Path, limit: int, follow_links: bool = False) -> int:
    """The size of `path` after checking, without opening it, that it is a regular file (no
    link unless `follow_links`) of at most `limit` bytes: for readers that take a path
    themselves (safetensors). FileNotFoundError when it is absent."""
    found = os.stat(path) if follow_links else os.lstat(path)
    _check_mode(found, limit)
    return found.st_size


def read_bytes(path: Path, limit: int, follow_links: bool = False) -> bytes:
    """The bytes of `path`: a regular file (no link unless `follow_links`) of at most
    `limit` bytes. FileNotFoundError when absent, StoredFileError for anything else."""
    flags = _FLAGS & ~getattr(os, "O_NOFOLLOW", 0) if follow_links else _FLAGS
    if not follow_links and not hasattr(os, "O_NOFOLLOW"):
        _check_mode(os.lstat(path), limit)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise StoredFileError("a symbolic link (not followed)") from None
        raise
    try:
        _check_mode(os.fstat(fd), limit)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew since the check
        raise StoredFileError(f"larger than {_size(limit)}")
    return data


def read_text(path: Path, limit: int, follow_links: bool = False) -> str:
    """The UTF-8 text of `path` (read_bytes' rules); StoredFileError when it is not UTF-8."""
    data = read_bytes(path, limit, follow_links)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StoredFileError(f"not UTF-8 text (byte {exc.start})") from None


def read_json(path: Path, limit: int, depth: int = JSON_DEPTH, follow_links: bool = False):
    """The JSON value of `path` (read_bytes' rules, then parse_json's)."""
    return parse_json(read_bytes(path, limit, follow_links), depth)


def parse_json(data: bytes | str, depth: int = JSON_DEPTH):
    """The JSON value in `data`: StoredFileError when it is not UTF-8 JSON, nests deeper than
    `depth` (checked before parsing: the parser recurses per level) or holds a lone
    surrogate (a "\\ud800" escape) in any string, key or value."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if nesting(raw, depth) > depth:
        raise StoredFileError(f"JSON nested deeper than {depth} levels")
    try:
        value = json.loads(raw.decode("utf-8"))  # UTF-8 only (json.loads would guess)
    except UnicodeDecodeError as exc:
        raise StoredFileError(f"not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise StoredFileError(f"not valid JSON ({exc.msg}, line {exc.lineno} column "
                              f"{exc.colno})") from None
    except (ValueError, RecursionError):  # e.g. an integer of thousands of digits
        raise StoredFileError("not JSON this app reads (a value out of range)") from None
    where = lone_surrogate(value)
    if where is not None:
        raise StoredFileError(f"{where} holds a lone surrogate (\\ud800-\\udfff): not text")
    return value


def nesting(data: bytes, stop: int) -> int:
    """How deeply the arrays and objects of the JSON text `data` nest (counted up to
    `stop` + 1: deeper is refused anyway). Strings are cut out first, so brackets inside
    them do not count."""
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    level = deepest = 0
    for byte in brackets:
        level += 1 if byte in b"[{" else -1
        if level > deepest:
            deepest = level
            if deepest > stop:
                break
    return deepest


def lone_surrogate(value) -> str | None:
    """Where in a parsed JSON value a string (or key) holds a lone surrogate, e.g.
    "messages[2].content"; None when none does."""
    todo = [("", value)]
    while todo:
        where, item = todo.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return where or "the text"
        elif isinstance(item, dict):
            for key, inner in item.items():
                if _SURROGATE.search(key):
                    return f"a key of {where or 'the object'}"
                todo.append((f"{where}.{key}" if where else key, inner))
        elif isinstance(item, list):
            todo.extend((f"{where}[{i}]", inner) for i, inner in enumerate(item))
    return None


def _check_mode(found: os.stat_result, limit: int) -> None:
    if stat.S_ISLNK(found.st_mode):
        raise StoredFileError("a symbolic link (not followed)")
    if stat.S_ISDIR(found.st_mode):
        raise StoredFileError("a folder, not a file")
    if not stat.S_ISREG(found.st_mode):
        raise StoredFileError("not a regular file")
    if found.st_size > limit:
        raise StoredFileError(f"larger than {_size(limit)}")


def _size(limit: int) -> str:
    return f"{limit / MIB:g} MiB" if limit >= MIB else f"{limit:,} bytes"
