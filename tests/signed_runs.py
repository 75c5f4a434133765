"""Helpers for the C2PA tests: keys made in the test, a signed run made through the CLI, images tampered with,
and a read-back through c2pa.Reader itself (the reference implementation, not our code)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from PIL import Image

from medbanana.cli import main
from medbanana.generation.backends.simulator.editor import SimulatedEditor
from medbanana.generation.records import EditedImage, decode_rgb
from medbanana.generation.rundir import layout
from medbanana.generation.rundir.provenance import jpeg_segments
from medbanana.generation.rundir.signing_keys import KeyFiles, init_keys


def make_keys(folder: Path) -> KeyFiles:
    return init_keys(folder, name="test signer")


def signed_run(sources: Path, out: Path, keys: KeyFiles, *extra: str) -> int:
    return main(["generate", "--backend", "simulator", "--sources", str(sources), "--out", str(out), "-q",
                 "--max-rounds", "3", "--c2pa-cert", str(keys.chain), "--c2pa-key", str(keys.key), *extra])


def run_images(run_dir: Path) -> dict[str, bytes]:
    """Every image of the run's layout that a journal round names, by relative path."""
    named = set()
    for line in (run_dir / layout.JOURNAL).read_text().splitlines():
        entry = json.loads(line)
        rounds = [entry["round"]] if entry["type"] == "round" else entry["record"]["rounds"]
        named.update(r["image"] for r in rounds if r.get("image"))
    return {rel: (run_dir / rel).read_bytes() for rel in sorted(named)}


def _mime(data: bytes) -> str:
    return "image/png" if data.startswith(b"\x89PNG\r\n\x1a\n") else "image/jpeg"


def reader_state(data: bytes, trust_pem: bytes | None = None) -> tuple[str, set[str]]:
    """('missing', {}) or c2pa.Reader's validation state and failure codes (default settings without anchors)."""
    import c2pa

    context = None
    if trust_pem is not None:
        context = c2pa.Context.from_dict({"verify": {"verify_trust": True},
                                          "trust": {"trust_anchors": trust_pem.decode()}})
    try:
        reader = c2pa.Reader.try_create(_mime(data), io.BytesIO(data), context=context)
    except c2pa.C2paError as exc:
        return "error", {type(exc).__name__}
    if reader is None:
        return "missing", set()
    with reader:
        results = reader.get_validation_results() or {}
        failures = {f["code"] for f in results.get("activeManifest", {}).get("failure", [])}
        return reader.get_validation_state(), failures


def manifest_store(data: bytes) -> dict:
    """The image's C2PA manifest store as c2pa.Reader reports it ({"active_manifest", "manifests": {...}})."""
    import c2pa

    with c2pa.Reader(_mime(data), io.BytesIO(data)) as reader:
        return json.loads(reader.json())


def active_assertion(data: bytes, label: str) -> dict:
    store = manifest_store(data)
    active = store["manifests"][store["active_manifest"]]
    return next(a["data"] for a in active["assertions"] if a["label"] == label)


class PngEditor(SimulatedEditor):
    """The simulator's editor answering PNG, as an editor backend of one's own might (`--editor
    signed_runs:PngEditor`): the run stores and signs the PNG bytes as they come."""

    name = "png"

    async def edit(self, task, source, instruction, seed) -> EditedImage:
        edited = await super().edit(task, source, instruction, seed)
        out = io.BytesIO()
        Image.fromarray(decode_rgb(edited.data)).save(out, format="PNG")
        return EditedImage(data=out.getvalue(), mime_type="image/png", model=edited.model, details=edited.details)


def one_scan_byte_changed(data: bytes) -> bytes:
    """The JPEG with one byte of its entropy-coded scan changed: a pixel block differs, the headers do not."""
    segments = jpeg_segments(data)
    scan_start = segments[-1][2]  # SOS is last: its payload ends where the scan data begins
    pos = scan_start + (len(data) - scan_start) // 2
    while data[pos] in (0xFF, 0x00) or data[pos - 1] == 0xFF:  # keep clear of markers and byte stuffing
        pos += 1
    return data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1:]


def without_manifest(data: bytes) -> bytes:
    """The JPEG without its APP11 (JUMBF, C2PA) segments: what a stripping tool leaves."""
    out = [b"\xff\xd8"]
    for marker, start, end in jpeg_segments(data):
        if marker == 0xEB:
            continue
        out.append(data[start - 4:end] if marker != 0xDA else data[start - 4:])
    return b"".join(out)
