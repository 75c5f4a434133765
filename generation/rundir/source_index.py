"""Find source images by task identity in a folder the user holds (sources are often not redistributable).

The folder follows the original scripts' input layout, `{D}/normal/<stem>.jpg` (sources of add tasks) and
`{D}/{Disease}/<stem>.jpg` (sources of remove tasks), or is any tree holding files named by source id.
Lookup order: the run's recorded `source_path`, then the input layout, then a unique file stem anywhere but in
another dataset's folder of the input layout.

Only files inside the folder are read: the walk does not enter linked folders, and a file found (a symlink, say)
goes through `layout.inside` before it is read; its bytes must be a JPEG or PNG image. Either failure is a
`confined.Refused` naming the file and the task it was looked up for.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

from .layout import IMAGE_SUFFIXES
from .confined import SOURCE_MISMATCH, Confined, Refused, inside
from ..failures import NotFound


class SourceIndex:
    def __init__(self, root: Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise NotFound(f"source images folder not found: {self.root}")
        self._by_stem: dict[str, list[str]] = {}
        self._dataset_dirs: set[str] = set()  # folders of the input layout's {D}: those holding normal/
        for folder, dirs, files in os.walk(self.root):  # followlinks=False: a linked folder is not entered
            if "normal" in dirs:
                self._dataset_dirs.add(os.path.relpath(folder, self.root).replace(os.sep, "/"))
            for name in files:
                stem, suffix = os.path.splitext(name)
                if suffix.lower() in IMAGE_SUFFIXES:
                    rel = os.path.relpath(os.path.join(folder, name), self.root).replace(os.sep, "/")
                    self._by_stem.setdefault(stem, []).append(rel)
        self._confined = Confined()
        self._digests: dict[tuple[str, int], str] = {}

    def __len__(self) -> int:
        """Image files in the folder."""
        return sum(map(len, self._by_stem.values()))

    def find(self, dataset: str | None, direction: str | None, disease: str | None, source_id: str,
             source_path: str | None = None) -> Path | None:
        """The source image file of a task, or None when this folder does not have it. Raises `confined.Refused`
        when the file found leads outside the folder."""
        rel = self._find(dataset, direction, disease, source_id, source_path)
        if rel is None:
            return None
        return inside(self.root, rel, _looked_up(dataset, direction, disease, source_id))

    def image_value(self, dataset: str | None, direction: str | None, disease: str | None, source_id: str,
                    source_path: str | None = None, sha256: str | None = None) -> dict | None:
        """`{"bytes", "path"}` for a datasets Image column: the file's bytes as they are, or None. Raises
        `confined.Refused` when the file leads outside the folder or is not a JPEG or PNG image, or, given the
        `sha256` the run recorded of the source it edited, when the file's content is another (SOURCE_MISMATCH:
        e.g. the original download rather than the prepared source, at another size)."""
        rel = self._find(dataset, direction, disease, source_id, source_path)
        if rel is None:
            return None
        value = self._confined.read_image(self.root, rel, lambda: _looked_up(dataset, direction, disease, source_id))
        if sha256 and value is not None and self._sha256(rel, value["bytes"]) != sha256:
            raise Refused(f"--source-images file {self.root / rel} is not the source the run edited for "
                          f"{dataset}/{direction}/{source_id} ({disease}): {_described(value['bytes'])}, and its "
                          f"SHA-256 differs from the run's record of that source; give --source-images the folder "
                          "the run read (`generate --sources`, e.g. a `prepare --out` folder), not the original "
                          "download", SOURCE_MISMATCH)
        return value

    def _sha256(self, rel: str, data: bytes) -> str:
        """The SHA-256 of the file `rel` read as `data`, hashed once: an add task's source serves every target."""
        digest = self._digests.get((rel, len(data)))  # one lookup: reader threads share the index
        if digest is None:
            digest = self._digests[(rel, len(data))] = hashlib.sha256(data).hexdigest()
        return digest

    def _find(self, dataset, direction, disease, source_id, source_path) -> str | None:
        candidates = self._by_stem.get(source_id, [])
        if source_path and source_path in candidates:
            return source_path
        class_dir = "normal" if direction == "add" else disease
        for rel in candidates:
            parts = rel.split("/")
            if len(parts) >= 2 and parts[-2] == class_dir and (dataset is None or dataset in parts[:-2]):
                return rel
        if len(candidates) == 1 and not self._in_other_dataset(candidates[0], dataset):
            return candidates[0]
        return None

    def _in_other_dataset(self, rel: str, dataset: str | None) -> bool:
        """Whether `rel` lies in another dataset's folder of the input layout: a file of the same stem there is
        that dataset's source (stems such as n00000 recur across datasets), not this task's."""
        parts = rel.split("/")[:-1]
        return dataset is not None and any(
            "/".join(parts[:i + 1]) in self._dataset_dirs and parts[i] != dataset for i in range(len(parts)))


def looked_for(dataset: str | None, direction: str | None, disease: str | None, source_id: str,
               source_path: str | None = None) -> str:
    """What `SourceIndex.find` looks for, in words: said when a source is not found."""
    names = f"{source_id}.{{{','.join(s.lstrip('.') for s in IMAGE_SUFFIXES)}}}"
    class_dir = "normal" if direction == "add" else disease
    layout = f"{dataset}/.../{class_dir}/{names}" if dataset else f"{class_dir}/{names}"
    return (f"{source_path} or " if source_path else "") + f"{layout}, or a single {names} anywhere"


def _described(data: bytes) -> str:
    """"1200x1000 pixels, 245,301 bytes": what a refused source is, from its header only."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return f"{image.width}x{image.height} pixels, {len(data):,} bytes"
    except (OSError, ValueError, Image.DecompressionBombError):
        return f"{len(data):,} bytes"


def _looked_up(dataset, direction, disease, source_id) -> str:
    return f"the source images lookup for {dataset}/{direction}/{source_id} ({disease})"
