"""SHA-256 manifest of a built dataset folder, in `sha256sum` format (`sha256sum -c SHA256SUMS` also checks it).

`verify_manifest` reads every line form GNU `sha256sum --strict -c` reads (coreutils `digest.c`, `split_3`):
`HEX  NAME` (text mode), `HEX *NAME` (binary mode), hex in either case, a leading `\\` for names written with
`\\\\`, `\\n` and `\\r` escapes, the tagged `SHA256 (NAME) = HEX` form, `#` comment and blank lines, CRLF ends and
the `md5 -r` style `HEX NAME` when a file uses it throughout. Unlike `sha256sum`, it then requires every name to be
a relative path inside the folder (`layout.inside`, symlinks resolved) without a `..` component and listed once,
and refuses the manifest, naming each bad line, before hashing anything. Files the manifest need not list: itself and
hidden files (`_listed_files`).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..failures import NotFound, UsageError
from ..files import atomic_write_bytes
from ..rundir import layout

MANIFEST = "SHA256SUMS"
_CHUNK = 8 * 2**20
_HEX = re.compile(r"[0-9A-Fa-f]{64}")
_WHITE = " \t"  # GNU's ISWHITE
_TAG = "SHA256"
_MIN_LINE = 64 + 1 + 1  # digest, one blank, a one-character name: shorter lines are misformatted in GNU too
_ESCAPES = {"\\": "\\", "n": "\n", "r": "\r"}
_SHOWN_ERRORS = 20


class ManifestError(UsageError):
    """A manifest line that is misformatted, names a path outside the folder, or repeats an entry."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _listed_files(folder: Path) -> list[str]:
    """Every file of the folder except the manifest and hidden files (.git, .cache of a Hub clone)."""
    files = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and rel.as_posix() != MANIFEST and not any(p.startswith(".") for p in rel.parts):
            files.append(rel.as_posix())
    return files


def manifest_line(digest: str, name: str) -> str:
    """One line as `sha256sum` writes it: a name holding `\\`, a newline or a CR gets GNU's escaped form."""
    if any(c in name for c in "\\\n\r"):
        escaped = name.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
        return f"\\{digest}  {escaped}\n"
    return f"{digest}  {name}\n"


def write_manifest(folder: Path, known: dict[str, str] | None = None) -> Path:
    """Write SHA256SUMS; `known` gives digests already computed (relative path -> hex), e.g. while writing."""
    folder = Path(folder)
    known = known or {}
    lines = [manifest_line(known.get(rel) or sha256_file(folder / rel), rel) for rel in _listed_files(folder)]
    target = folder / MANIFEST
    atomic_write_bytes(target, "".join(lines).encode("utf-8", errors="surrogateescape"))
    return target


@dataclass
class VerifyReport:
    checked: int = 0
    missing: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.changed or self.unlisted)

    def describe(self) -> str:
        if self.ok:
            return f"OK: {self.checked} files match {MANIFEST}"
        parts = [f"{len(items)} {what}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
                 for what, items in (("missing", self.missing), ("changed", self.changed),
                                     ("not in the manifest", self.unlisted)) if items]
        return "FAILED: " + "; ".join(parts)


def _unescape(name: str) -> str | None:
    """GNU's `filename_unescape`: only `\\\\`, `\\n` and `\\r`; anything else after a backslash is invalid."""
    out, chars = [], iter(name)
    for c in chars:
        if c == "\\":
            c = _ESCAPES.get(next(chars, ""))
            if c is None:
                return None
        out.append(c)
    return "".join(out)


def parse_line(line: str, style: list[str | None]) -> tuple[str, str] | None:
    """(hex digest, file name) of one line without its line end, or None where `sha256sum -c` calls it
    improperly formatted. `style` ([None] at the start of a file) carries GNU's rule that a file uses either
    `HEX  NAME` lines or `md5 -r`'s `HEX NAME` lines, never both (a name starting with a blank stays unambiguous).
    """
    i, n = 0, len(line)
    while i < n and line[i] in _WHITE:
        i += 1
    escaped = line.startswith("\\", i)
    i += escaped
    if line.startswith(_TAG, i):  # tagged: SHA256 (NAME) = HEX, the name ends at the last ')'
        i += len(_TAG)
        i += line.startswith(" ", i)
        if not line.startswith("(", i):
            return None
        rest = line[i + 1:]
        close = rest.rfind(")")
        if close < 0:
            return None
        name, tail = rest[:close], rest[close + 1:].lstrip(_WHITE)
        digest = tail[1:].lstrip(_WHITE) if tail.startswith("=") else ""
        if escaped:
            name = _unescape(name)
        return (digest, name) if name is not None and _HEX.fullmatch(digest) else None
    if n - i < _MIN_LINE:
        return None
    start = i
    while i < n and line[i] not in _WHITE:
        i += 1
    if i == n or not _HEX.fullmatch(line[start:i]):
        return None
    digest, i = line[start:i], i + 1
    if n - i == 1 or line[i] not in " *":  # `HEX NAME`: one blank, no mode character
        if style[0] == "standard":
            return None
        style[0] = "reversed"
    elif style[0] != "reversed":
        style[0] = "standard"
        i += 1  # the mode character: ' ' text, '*' binary (the same bytes are hashed on POSIX)
    name = _unescape(line[i:]) if escaped else line[i:]
    return (digest, name) if name is not None else None


def read_manifest(folder: Path) -> dict[str, tuple[str, Path | None]]:
    """Entry name (normalised) -> (hex digest, resolved path inside `folder`, None for a name ending in '/');
    ManifestError names every bad line."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise NotFound(f"{manifest} not found: is {folder} a folder made by `medbanana build`?")
    path = layout.inside(folder, MANIFEST, named_by=f"the folder {folder}")
    entries: dict[str, tuple[str, Path | None]] = {}
    first_line: dict[str, int] = {}
    errors, style = [], [None]
    # bytes split on b"\n" only, as getline does (str.splitlines would also split on \x0b, \x1c, U+2028, ...)
    for line_no, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        if raw.startswith(b"#"):
            continue
        line = os.fsdecode(raw.removesuffix(b"\r"))  # file names are bytes: undecodable ones survive
        if not line:
            continue
        where = f"{manifest}:{line_no}"
        parsed = None if "\x00" in line else parse_line(line, style)
        if parsed is None:
            errors.append(f"{where}: not a `sha256sum` line (`<sha256>  <path>`, `<sha256> *<path>` or "
                          f"`SHA256 (<path>) = <sha256>`)")
            continue
        digest, name = parsed
        try:
            target = layout.inside(folder, name, named_by=where)
        except layout.UnsafePath as exc:
            errors.append(str(exc))
            continue
        if ".." in Path(name).parts:  # `alias/../x` hashes where the link points, but its key would be `x`
            errors.append(f"{where}: {name!r} has a '..' component; name each file by its path from {folder}")
            continue
        key = Path(os.path.normpath(name)).as_posix()
        if key in entries:
            errors.append(f"{where}: {name!r} is listed again (first on line {first_line[key]})")
            continue
        # a trailing '/' names a directory, never a regular file (sha256sum fails it too)
        entries[key] = (digest.lower(), None if name.endswith("/") else target)
        first_line[key] = line_no
    if not entries and not errors:
        errors.append(f"{manifest}: no checksum lines")
    if errors:
        more = f"\n... and {len(errors) - _SHOWN_ERRORS} more" if len(errors) > _SHOWN_ERRORS else ""
        raise ManifestError(f"{manifest} is refused, nothing was checked:\n" +
                            "\n".join(errors[:_SHOWN_ERRORS]) + more)
    return entries


def verify_manifest(folder: Path) -> VerifyReport:
    folder = Path(folder)
    report = VerifyReport()
    entries = read_manifest(folder)
    for key, (digest, target) in entries.items():
        if target is None or not target.is_file():  # a FIFO or a device would block or never end
            report.missing.append(key)
        elif sha256_file(target) != digest:
            report.changed.append(key)
        report.checked += 1
    report.unlisted = [rel for rel in _listed_files(folder) if rel not in entries]
    return report
