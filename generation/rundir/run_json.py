"""Reading a run's JSON files safely: a file is read only from inside the run, must be UTF-8 and valid JSON, and a
JSON object of tasks may name each task key once; entries are decoded one by one, so a malformed entry is a
refusal naming the file, the entry and the field (msgspec's `$...` path) instead of a traceback.

Errors that make a whole file unreadable (syntax, encoding, a duplicate task key) are ValueErrors that stop the
build whatever the `--unsafe` policy: there is no entry to leave out. A malformed entry is a `confined.Refused`.
"""

from __future__ import annotations

import codecs
import itertools
import json
import mmap
import re
from collections import Counter
from pathlib import Path

import msgspec

from . import schema
from .confined import MALFORMED, Refused, inside
from ..failures import UsageError

ENTRIES = msgspec.json.Decoder(dict[str, msgspec.Raw])
_CHUNK = 1 << 20
# the top level of a JSON object, to see every key as written (msgspec's dict keeps the last of equal keys)
_OPEN = re.compile(rb"\s*\{\s*")
_STRING = rb'("[^"\\]*(?:\\.[^"\\]*)*")'  # a JSON string, escapes included
_KEY = re.compile(_STRING + rb"\s*:\s*")
_NEXT_KEY = re.compile(rb"\s*,\s*" + _STRING + rb"\s*:\s*")
_END = re.compile(rb"\s*\}\s*\Z")


def load(run_dir: Path, relative: str, named_by: str, scope: str | None = None):
    """The bytes of a JSON file inside the run (a read-only mapping, or b"" when empty); None when absent.
    Raises Refused when the path leads outside the run, or outside `scope` (`confined.inside`), e.g. by a symlink."""
    path = inside(run_dir, relative, named_by, scope)
    if not path.is_file():
        return None
    with open(path, "rb") as fh:
        # a read-only mapping: no copy of the file; raw thinking summaries keep it open while in use
        data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else b""
    require_utf8(data, Path(run_dir) / relative)
    return data


def require_utf8(data, path: Path) -> None:
    """msgspec checks the strings it decodes, not those it skips or keeps raw (thinking summaries, decoded when
    rows are written): check the whole file first. Copied in 1 MB chunks into one buffer (a fresh copy of a big
    file costs more in page faults than the check) and only scanned when ASCII, as most chunks are (~6 GB/s)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    buffer = bytearray(min(_CHUNK, len(data)))
    view, source = memoryview(buffer), memoryview(data)
    start = 0
    try:
        for start in range(0, len(data), _CHUNK):
            size = min(_CHUNK, len(data) - start)
            view[:size] = source[start:start + size]
            chunk = view[:size]
            if not (buffer.isascii() if size == len(buffer) else chunk.tobytes().isascii()) \
                    or decoder.getstate()[0]:
                decoder.decode(chunk.tobytes())  # keeps a character cut at the chunk's end for the next
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {start + exc.start}: {exc.reason}); "
                         "JSON files must be UTF-8") from None
    finally:
        view.release()
        source.release()


def decode(data, decoder: msgspec.json.Decoder, path: Path):
    """The whole file decoded; a ValueError naming the file (and msgspec's `$...` path) when it cannot be."""
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # DecodeError covers ValidationError
        raise UsageError(f"{path}: {exc}") from None


def entries(data, path: Path) -> dict[str, msgspec.Raw]:
    """A JSON object of tasks: key -> its entry, still raw; a ValueError when a key appears twice."""
    found = decode(data, ENTRIES, path)
    if found and not _keys_once(data, found):
        _require_unique_keys_slowly(data, path)
    return found


class _CountedConversation(schema.Conversation, gc=False):
    """An entry that counts itself when decoded: a key written twice decodes two values into one dict item."""

    def __post_init__(self):
        next(_DECODED)


_DECODED = itertools.count()  # entries decoded, by every thread: another thread's only adds (see `conversations`)
_CONVERSATIONS = msgspec.json.Decoder(dict[str, _CountedConversation])


def conversations(data, path: Path) -> dict[str, schema.Conversation] | None:
    """All of an `all_conversations.json`'s entries decoded in one pass (about 40 % less time than `entries` and
    then each entry); None when one is malformed, for the caller to decode them one by one (`entries`, `decode_entry`)
    and refuse that one by name. A ValueError when a key appears twice."""
    before = next(_DECODED)
    try:
        found = _CONVERSATIONS.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    # a file without a repeated key decoded one entry per item; more (or another thread decoding meanwhile)
    # sends it to the exact check
    if next(_DECODED) - before - 1 != len(found):
        _require_unique_keys_slowly(data, path)
    return found


def decode_entry(decoder: msgspec.json.Decoder, raw: msgspec.Raw, path: Path, key: str):
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise Refused(f"{path}, entry {key!r}: {exc}", MALFORMED) from None


def _keys_once(data, found: dict[str, msgspec.Raw]) -> bool:
    """Walk the object's top level, skipping each value by the length of the entry msgspec kept for its key
    (the last of equal keys): True when every key was seen once. A key written twice is seen twice when its
    values have the same length, and otherwise makes the walk lose its place (it lands inside a value, where
    `, "<a key of this file>": ` followed by a consistent chain to the end of the file is not found by accident);
    any surprise sends the caller to the exact, slow check."""
    seen = set()
    m, end = _KEY.match(data, _OPEN.match(data).end()), -1
    while m is not None:
        quoted = m[1]
        key = quoted[1:-1].decode() if b"\\" not in quoted else msgspec.json.decode(quoted)
        raw = found.get(key)
        if raw is None or key in seen:
            return False
        seen.add(key)
        end = m.end() + len(raw)
        m = _NEXT_KEY.match(data, end)
    return end >= 0 and _END.match(data, end) is not None and len(seen) == len(found)


def statuses(data, path: Path) -> dict:
    """progress.json, small and flat: read with the json module, whose object_pairs_hook sees every key
    (values are checked by the reader: a status must be one it knows)."""
    try:
        pairs = json.loads(bytes(data), object_pairs_hook=_Pairs)
    except ValueError as exc:  # JSONDecodeError
        raise UsageError(f"{path}: {exc}") from None
    if not isinstance(pairs, _Pairs):  # bad input, told as the ValueError every unreadable file is
        raise UsageError(f"{path}: not a JSON object of task statuses")  # noqa: TRY004
    _require_once(pairs, path)
    return dict(pairs)


class _Pairs(list):
    """A JSON object as its (key, value) list, every key kept."""


def _require_unique_keys_slowly(data, path: Path) -> None:
    _require_once(json.loads(bytes(data), object_pairs_hook=_Pairs), path)


def _require_once(pairs: list, path: Path) -> None:
    twice = sorted(key for key, n in Counter(key for key, _ in pairs).items() if n > 1)
    if twice:
        more = f" (and {len(twice) - 1} more)" if len(twice) > 1 else ""
        raise UsageError(f"{path}: task key {twice[0]!r}{more} appears more than once; a JSON object keeps only "
                         "the last entry of a key, so the others would be lost: keep one entry per task")
