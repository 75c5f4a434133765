"""The global geometric change between a source and its edit: translation, scale (per axis: zoom and aspect),
rotation, flip and canvas size, measured on downscaled greyscale; `estimate_geometry` is the one pure function
(generate's geometry guard, the build's alignment columns, `eval`'s registration and the bench call it).

Model: the anatomy at source pixel p (relative to the source's centre) is found in the edit, once the edit is
resized to the source's canvas, at q = A p + t (relative to the same centre). A = R(rotation) diag(sx, sy) F, with
F a mirror when the edit was flipped. A canvas of another size is resized first, since every consumer (masks, CP,
export) compares them that way: a resolution change alone is no misalignment, a crop to another aspect is (it
shows as sx != sy).

1. Both images as grey at WORK_SIDE px (longest side; a JPEG decoded at the smallest DCT scale at least that size),
   the edit resized to the source's working grid.
2. Phase correlation of BLOCKS x BLOCKS overlapping half-size blocks (Hann window, whitened cross-power spectrum
   under a Gaussian of PEAK_SIGMA px, sub-pixel peak by a log-parabola): one displacement per block; an affine fit
   d = (A - I) p + t over the blocks, reweighted to drop blocks that disagree (the lesion, a region the editor
   repainted, a textureless corner).
3. When the blocks do not agree (a rotation or zoom large enough to decorrelate a block, a shift past a quarter
   block), Fourier-Mellin: the whitened magnitude spectra at FM_SIDE px in log-polar coordinates
   (skimage.transform.warp_polar), phase-correlated (skimage.registration.phase_cross_correlation) give rotation
   (modulo 180 degrees: both are tried) and scale; a global phase correlation gives the coarse translation; the
   edit is warped back by that and step 2 refines. A flipped edit is tried when nothing explains the pair.
The fit with the higher block agreement wins; `match` says how well it explains the pair (0-1). A pair whose best
fit does not beat chance (registration.chance_bar: a blank or unrelated image) is not measured (None).

Tolerances are stated at 1024 px (the longest side) and scale with the image: SHIFT_TOLERANCE px of translation,
SCALE_TOLERANCE per axis, ROTATION_TOLERANCE degrees, no flip. The guard (`check_edit`, generate's `--geometry`
GEOMETRY_MODES) keeps an aligned edit, and rejects, registers (`registered`: warped back onto the source's grid)
or records one that moved; past the REGISTRABLE limits an edit is not warped back (too much of the frame would be
missing), and `register` rejects it instead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from .records import GEOMETRY_MODES, EditedImage, SourceImage, Verdict, decode_rgb, encode_jpeg
from .registration import BLOCKS, FM_SIDE, MIRRORS, WORK_SIDE, PreparedSource, fit_pair, prepare_source, warp_to_source
from .failures import UsageError

REFERENCE_SIDE = 1024  # px: where the tolerances are stated
SHIFT_TOLERANCE = 1.0  # px at 1024
SCALE_TOLERANCE = 0.01  # per axis
ROTATION_TOLERANCE = 0.5  # degrees
REGISTRABLE = {"shift": 0.08, "scale": 0.15, "rotation": 8.0}  # of the longest side / per axis / degrees
MIN_SIDE = 64  # px: smaller images are not measured (their blocks are too small to tell a match from chance)
METHOD = (f"grey at {WORK_SIDE} px; phase correlation of {BLOCKS}x{BLOCKS} half-size blocks, robust affine fit; "
          f"Fourier-Mellin (log-polar magnitude spectra at {FM_SIDE} px) when the blocks disagree; tolerances at "
          f"{REFERENCE_SIDE} px: {SHIFT_TOLERANCE:g} px, {SCALE_TOLERANCE:.0%} per axis, {ROTATION_TOLERANCE:g} deg")
GUARD_MODEL = "medbanana-geometry-guard"  # the model named by the verdict of an edit rejected for its frame
# what the guard did with an edit (the `action` of a round's `geometry` record): its frame was within tolerance; it
# was warped back onto the source's grid; rejected before the judge; judged as it came (--geometry record); not
# measurable
ACTIONS = ("kept", "registered", "rejected", "recorded", "unmeasured")


@dataclass(frozen=True)
class Geometry:
    """An edit's geometric change relative to its source (module docstring), in source pixels."""

    dx: float  # px: where the source's centre lies in the edit (resized to the source's canvas), minus the centre
    dy: float
    scale_x: float  # the edit's content over the source's, per axis (1: unchanged)
    scale_y: float
    rotation_deg: float  # positive: the content turned clockwise as seen (image y points down)
    flip: str  # "" | "horizontal" | "vertical"
    source_size: tuple[int, int]  # (width, height)
    edit_size: tuple[int, int]
    match: float  # 0-1: how well the fit explains the pair (the agreeing blocks' mean correlation peak)
    stage: str  # "blocks" | "fourier-mellin": which start the fit came from

    @property
    def shift_px(self) -> float:
        return math.hypot(self.dx, self.dy)

    @property
    def scale(self) -> float:
        """The geometric mean of the per-axis scales."""
        return math.sqrt(abs(self.scale_x * self.scale_y))

    def _reference(self) -> float:
        return max(self.source_size) / REFERENCE_SIDE

    def problems(self) -> list[str]:
        """What puts the edit out of tolerance, in words; [] when it is aligned."""
        found = []
        if self.flip:
            found.append(f"flipped {self.flip}ly")
        if self.shift_px > SHIFT_TOLERANCE * self._reference():
            found.append(f"shifted {self.shift_px:.1f} px (dx {self.dx:+.1f}, dy {self.dy:+.1f})")
        if max(abs(self.scale_x - 1), abs(self.scale_y - 1)) > SCALE_TOLERANCE:
            if abs(self.scale_x - self.scale_y) > SCALE_TOLERANCE:
                found.append(f"stretched {self.scale_x - 1:+.1%} across, {self.scale_y - 1:+.1%} down")
            else:
                found.append(f"{'zoomed in' if self.scale > 1 else 'zoomed out'} {abs(self.scale - 1):.1%}")
        if abs(self.rotation_deg) > ROTATION_TOLERANCE:
            found.append(f"rotated {self.rotation_deg:+.1f} deg")
        return found

    @property
    def aligned(self) -> bool:
        return not self.problems()

    @property
    def registrable(self) -> bool:
        """Small enough to be warped back without losing much of the frame (REGISTRABLE)."""
        return (self.shift_px <= REGISTRABLE["shift"] * max(self.source_size)
                and max(abs(self.scale_x - 1), abs(self.scale_y - 1)) <= REGISTRABLE["scale"]
                and abs(self.rotation_deg) <= REGISTRABLE["rotation"])

    def describe(self) -> str:
        """One line: what changed, or that the frame is kept."""
        problems = self.problems()
        canvas = "" if self.edit_size == self.source_size else (
            f"; canvas {self.edit_size[0]}x{self.edit_size[1]} for a {self.source_size[0]}x{self.source_size[1]} "
            "source")
        return ("frame kept" if not problems else "the frame moved: " + ", ".join(problems)) + canvas

    def matrix(self) -> np.ndarray:
        """A (x, y; source pixels, about the centre) as a 2x2 array."""
        c, s = math.cos(math.radians(self.rotation_deg)), math.sin(math.radians(self.rotation_deg))
        return np.array([[c, -s], [s, c]]) @ np.diag([self.scale_x, self.scale_y]) @ MIRRORS[self.flip]

    def to_json(self) -> dict:
        """The measurement as a round's `geometry` records it (with `aligned`, `shift_px` and `scale`)."""
        raw = asdict(self)
        raw.update(source_size=list(self.source_size), edit_size=list(self.edit_size))
        rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in raw.items()}
        return {**rounded, "aligned": self.aligned, "shift_px": round(self.shift_px, 3), "scale": round(self.scale, 5)}

    @classmethod
    def from_json(cls, raw: dict) -> "Geometry":
        """Back from `to_json` (derived keys ignored); KeyError / TypeError / ValueError for anything else."""
        return cls(dx=float(raw["dx"]), dy=float(raw["dy"]), scale_x=float(raw["scale_x"]),
                   scale_y=float(raw["scale_y"]), rotation_deg=float(raw["rotation_deg"]), flip=str(raw["flip"]),
                   source_size=_size(raw["source_size"]), edit_size=_size(raw["edit_size"]),
                   match=float(raw["match"]), stage=str(raw["stage"]))


def _size(value) -> tuple[int, int]:
    width, height = value
    return int(width), int(height)


def estimate_geometry(source: bytes | np.ndarray | PreparedSource, edited: bytes | np.ndarray) -> Geometry | None:
    """The geometric change from `source` to `edited` (image bytes, uint8 arrays H x W [x 3], or a source made by
    `registration.prepare_source`); None when it cannot be measured: an image smaller than MIN_SIDE, or nothing in
    the pair matches (an unrelated or blank image). ValueError for an unreadable image. Pure: a source's working
    image is kept (by its bytes' SHA-256) for the next edit of the same source."""
    prepared = source if isinstance(source, PreparedSource) else prepare_source(source)
    if min(prepared.size) < MIN_SIDE:
        return None
    fit, edit_size = fit_pair(prepared, edited)
    if fit is None or min(edit_size) < MIN_SIDE:
        return None
    turned = fit.matrix @ MIRRORS[fit.flip]  # = R diag(sx, sy)
    rotation = math.atan2(turned[1, 0] - turned[0, 1], turned[0, 0] + turned[1, 1])
    c, s = math.cos(rotation), math.sin(rotation)
    unturned = np.array([[c, s], [-s, c]]) @ turned
    return Geometry(dx=float(fit.shift[0]), dy=float(fit.shift[1]), scale_x=float(unturned[0, 0]),
                    scale_y=float(unturned[1, 1]), rotation_deg=math.degrees(rotation), flip=fit.flip,
                    source_size=prepared.size, edit_size=edit_size, match=fit.match, stage=fit.stage)


def registered(edited: bytes | np.ndarray, geometry: Geometry) -> np.ndarray:
    """The edit (bytes, or uint8 RGB) warped back onto its source's grid by `geometry`: uint8 RGB of the source's
    size, black where the edit does not show the source's frame."""
    rgb = decode_rgb(edited) if isinstance(edited, bytes) else np.asarray(edited, dtype=np.uint8)
    if rgb.ndim == 2:
        rgb = np.repeat(rgb[..., None], 3, axis=-1)
    return warp_to_source(rgb, geometry.matrix(), np.array([geometry.dx, geometry.dy]), geometry.source_size)


@dataclass(frozen=True)
class GeometryCheck:
    """The guard's answer for one edit: what it did (ACTIONS), the measurement, and the image that goes on to the
    judge, the masks and the metrics (warped back when `registered`, carrying the editor's bytes as `original`)."""

    action: str
    geometry: Geometry | None
    edited: EditedImage
    note: str = ""  # why an edit was not measured

    def record(self) -> dict:
        """The round's `geometry`: the measurement (Geometry.to_json) and the action."""
        measured = self.geometry.to_json() if self.geometry is not None else {}
        return {**measured, "action": self.action, **({"note": self.note} if self.note else {})}


def check_edit(mode: str, source: SourceImage, edited: EditedImage) -> GeometryCheck:
    """The geometry guard under `mode` (GEOMETRY_MODES): an aligned edit is kept; a misaligned one is rejected
    (reject, or register past the REGISTRABLE limits), warped back onto the source's grid (register) or kept as it
    came (record). An edit that cannot be measured goes on as it came, said so."""
    if mode not in GEOMETRY_MODES:
        raise UsageError(f"unknown geometry mode {mode!r}; use one of {', '.join(GEOMETRY_MODES)}")
    try:
        geometry = estimate_geometry(prepare_source(source.data, key=source.sha256), edited.data)
    except ValueError as exc:
        return GeometryCheck("unmeasured", None, edited, f"{exc}")
    if geometry is None:
        return GeometryCheck("unmeasured", None, edited, "too small, or nothing in the pair matches")
    if geometry.aligned:
        return GeometryCheck("kept", geometry, edited)
    if mode == "record":
        return GeometryCheck("recorded", geometry, edited)
    if mode == "reject" or not geometry.registrable:
        return GeometryCheck("rejected", geometry, edited)
    moved = encode_jpeg(registered(edited.data, geometry), quality=95)
    return GeometryCheck("registered", geometry, registered_edit(edited, moved))


def registered_edit(edited: EditedImage, moved: bytes) -> EditedImage:
    """`edited` with `moved` (its registered JPEG) as its image, the editor's own bytes kept as `original`."""
    return replace(edited, data=moved, mime_type="image/jpeg", original=edited.data)


def frame_verdict(check: GeometryCheck) -> Verdict:
    """The verdict of an edit rejected for its frame, before any judge saw it: not qualified, fidelity not
    preserved, the rest not judged (written null); its reason is what the writer reads."""
    assert check.geometry is not None
    limit = "" if check.geometry.registrable else " (too far to be warped back)"
    return Verdict(has_disease=False, structure_reasonable=False, looks_realistic=False, fidelity_preserved=False,
                   qualified=False, score=0.0, model=GUARD_MODEL, unjudged=_UNJUDGED,
                   reason=f"Rejected before judging: {check.geometry.describe()}{limit}. The edited image must keep "
                          "the original's exact frame: same position, size, zoom, orientation and canvas.",
                   details={"geometry": check.record()})


_UNJUDGED = ("has_disease", "structure_reasonable", "looks_realistic")
