"""What `medbanana build` refuses to read or embed, and how a refusal is told.

Every path named by data (run JSON, a records file, an image-only folder's listing, a source lookup) goes through
`generation.rundir.layout.inside`, the one containment rule; every image file must be a JPEG or PNG whose header Pillow
reads before its bytes go into parquet. A refusal is a `Refused` (a ValueError) whose message names the file, what
named it (JSON file, entry, round) and the reason; the build's `--unsafe` policy decides whether it stops the build
or leaves the task out and lists the refusal in the build's statistics.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

from . import layout
from ..failures import UsageError

POLICIES = ("error", "skip")
OUTSIDE = "outside its root"  # kinds of refusal, as counted in the build's statistics
NOT_IMAGE = "not an image"
MALFORMED = "malformed entry"
INCONSISTENT = "inconsistent entry"  # well-formed, but its files disagree (a success whose accepted edit failed, ...)
SOURCE_MISMATCH = "not the run's source"  # a --source-images file whose SHA-256 is not the one the run recorded

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", None)  # None on Windows: every file then goes through layout.inside
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)  # a FIFO must not block
_SYMLINK_ERRNOS = {errno.ELOOP, errno.EMLINK}  # what open(O_NOFOLLOW) gives on a symlink (Linux/macOS, BSD)


class Refused(UsageError):
    """An input the build will not use. The message names the file, what named it, and why."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):  # travels from build workers to the parent
        return Refused, (str(self), self.kind)


class NotRegular(UsageError):
    """What stands at a data-named path is no file to read (a folder, a device, a FIFO: `too_large` False) or is a
    file too large to read (`too_large` True). The message names the path."""

    def __init__(self, message: str, too_large: bool = False):
        super().__init__(message)
        self.too_large = too_large


def handle(exc: Refused, refused) -> None:
    """Raise `exc` (policy `error`: `refused` is None) or hand it to `refused` to be recorded (policy `skip`)."""
    if refused is None:
        raise exc
    refused(exc)


def inside(root: Path, relative: str, named_by: str, scope: str | None = None) -> Path:
    """`layout.inside`, with its UnsafePath told as a refusal. `scope`: the output folder of `root` the user named
    (`{D}-edit`) when a build or evaluation was given that folder rather than its run: the path must then stay in
    it or its `-failed` sibling (`layout.inside_named_folder`)."""
    try:
        if scope is None:
            return layout.inside(root, relative, named_by=named_by)
        return layout.inside_named_folder(root, scope, relative, named_by=named_by)
    except layout.UnsafePath as exc:
        raise Refused(str(exc), OUTSIDE) from None


class Confined:
    """Paths and reads under roots, each through `layout.inside`.

    Resolving a path costs ~60 µs and a run has hundreds of thousands of images in a few dozen folders: the rule
    is applied once per folder (cached for this object's life, one unit or one source folder), and to the whole
    path whenever the file itself is a symlink (opening it with O_NOFOLLOW tells) or its name is `.`/`..`.
    Every method takes the `scope` of `inside`: None, or the output folder the user named.
    """

    def __init__(self):
        self._folders: dict[tuple[Path, str | None, str], Path | None] = {}
        # (root, scope, its folders found inside it) for the root last checked: `check`'s fast path, for every
        # attempt of a unit; one attribute, so that a thread never sees one root with another's folders
        self._last: tuple[Path | None, str | None, set[str]] = (None, None, set())

    def path(self, root: Path, relative: str, named_by, scope: str | None = None) -> Path:
        """The path with its folder resolved, required inside `root`; the file itself may still be a symlink.
        `named_by`: a text, or a function giving it (built only for a refusal)."""
        real = self._folder(root, relative, scope)
        if real is None:
            return inside(root, relative, _text(named_by), scope)
        return real / relative.rpartition("/")[2]

    def check(self, root: Path, relative: str, named_by, scope: str | None = None) -> None:
        """Raise Refused unless `relative` stays inside `root`, for a path that is recorded, not read (a read
        checks the file itself too)."""
        folder, _, leaf = relative.rpartition("/")
        last_root, last_scope, folders = self._last
        if root is last_root and scope == last_scope and folder in folders and leaf not in ("", ".", "..") \
                and "\x00" not in leaf:
            return
        if self._folder(root, relative, scope) is None:
            inside(root, relative, _text(named_by), scope)
        else:  # an ordinary name in a folder inside the root
            if root is not last_root or scope != last_scope:
                folders = set()
                self._last = (root, scope, folders)
            folders.add(folder)

    def _folder(self, root: Path, relative: str, scope: str | None) -> Path | None:
        """The resolved folder of `relative` when it is inside `root` and the file's name is an ordinary one;
        None when the whole path must go through the rule."""
        folder, _, leaf = relative.rpartition("/")
        if not folder or leaf in ("", ".", "..") or "\x00" in leaf:
            return None
        key = (root, scope, folder)
        real = self._folders.get(key, key)
        if real is key:
            try:
                real = inside(root, folder, "", scope)
            except Refused:
                real = None
            self._folders[key] = real
        return real

    def read(self, root: Path, relative: str, named_by, scope: str | None = None) -> bytes | None:
        """The bytes of a regular file inside `root`, or None when there is none at that path (a folder, a device
        or a FIFO named like a file is as good as missing)."""
        try:
            return self.read_at_most(root, relative, named_by, scope)
        except NotRegular:
            return None

    def read_at_most(self, root: Path, relative: str, named_by, scope: str | None = None,
                     most: int | None = None) -> bytes | None:
        """`read`, telling what stands at the path: None when nothing does; NotRegular (naming the path) for a
        folder, a device or a FIFO, or (with `most`) a file of more than `most` bytes, which is not read."""
        path = self.path(root, relative, named_by, scope)
        try:
            fd = _open(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno not in _SYMLINK_ERRNOS:
                raise
            fd = None
        if fd is None:  # a symlink: followed only when its target is inside the root too
            path = inside(root, relative, _text(named_by), scope)
            try:
                fd = os.open(path, _OPEN_FLAGS)
            except (FileNotFoundError, NotADirectoryError):
                return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):  # checked on the descriptor: open() of a folder's would raise
                kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
                raise NotRegular(f"{path} (named by {_text(named_by)}) is {kind}")
            if most is not None and info.st_size > most:
                raise NotRegular(f"{path} (named by {_text(named_by)}) is {info.st_size:,} bytes, more than the "
                                 f"{most:,} it may have; not read", too_large=True)
        except BaseException:
            os.close(fd)
            raise
        with open(fd, "rb") as fh:
            return fh.read()

    def read_image(self, root: Path, relative: str, named_by, scope: str | None = None) -> dict | None:
        """`{"bytes", "path"}` for an Image column, the bytes as they are; None when the file is missing.
        Raises Refused when the path leads outside `root` or the bytes are not a JPEG or PNG image."""
        data = self.read(root, relative, named_by, scope)
        if data is None:
            return None
        problem = image_problem(data)
        if problem:
            raise Refused(f"{Path(root) / relative} (named by {_text(named_by)}): not an image: {problem}", NOT_IMAGE)
        return {"bytes": data, "path": relative}


def _text(named_by) -> str:
    return named_by() if callable(named_by) else named_by


def _open(path: Path) -> int:
    if _NOFOLLOW is None:
        raise OSError(errno.ELOOP, "no O_NOFOLLOW here: resolve every path")
    return os.open(path, _OPEN_FLAGS | _NOFOLLOW)


def image_problem(data: bytes) -> str | None:
    """Why `data` is not a complete JPEG or PNG image, or None when it is one.

    Magic bytes, then Pillow reads the header (size and format); PNG chunks are checked up to IEND by
    `verify()`, a JPEG must end with its end-of-image marker (Pillow's JPEG `verify()` reads nothing, and a
    truncated JPEG's header reads fine). Pixels are not decoded: that would cost more than the build itself.
    """
    if not data:
        return "an empty file"
    if data.startswith(JPEG_MAGIC):
        kind = "JPEG"
    elif data.startswith(PNG_MAGIC):
        kind = "PNG"
    else:
        return "it does not start with a JPEG or PNG signature"
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=[kind]) as image:
            width, height = image.size
            if kind == "PNG":
                image.verify()
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds on bad input (OSError, SyntaxError,
        # DecompressionBombError, struct.error, ...): each means the same here
        return f"Pillow cannot read it as {kind} ({exc.__class__.__name__}: {exc})"
    if width < 1 or height < 1:
        return f"a {kind} of {width}x{height} pixels"
    if kind == "JPEG" and not data.rstrip(b"\x00").endswith(b"\xff\xd9"):
        return "a truncated JPEG (no end-of-image marker)"
    return None
