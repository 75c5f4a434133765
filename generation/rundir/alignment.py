"""A task's alignment columns (`aligned`, `shift_px`, `scale`, `rotation_deg`): from the geometry guard's record of
each round (generate measured every edit, generation/geometry.py), else measured here from the source and the
attempt image when the build has the source (a released run, or a run from before the guard), else null.

`aligned` says whether the row's edited image lies on its source's grid within the guard's tolerances: true for an
edit the run warped back (`--geometry register`: the row holds the registered image); `shift_px`, `scale` and
`rotation_deg` are the change the editor made, as measured, at the source's resolution.
"""

from __future__ import annotations

from collections import Counter

from .schema import GeometryRecord
from .task_records import AttemptRecord, TaskRecord

RECORDED, COMPUTED, MISSING = "recorded", "computed", "missing"  # where an attempt image's alignment came from
COLUMNS = ("aligned", "shift_px", "scale", "rotation_deg")


def fill_geometry(task: TaskRecord, images: dict[str, dict | None], source: dict | None) -> Counter:
    """Measure the attempts that have an image but no recorded geometry, from `source` (an Image value; None: they
    stay without). Counts the attempt images by (origin, what was found): origin RECORDED / COMPUTED / MISSING,
    found an ACTIONS word of generation/geometry.py for recorded ones, else aligned / misaligned / unmeasured."""
    counts: Counter = Counter()
    prepared = None
    for attempt in task.attempts:
        value = images.get(attempt.image) if attempt.image else None
        if value is None:
            continue
        if attempt.geometry is not None:
            counts[(RECORDED, attempt.geometry.action or "measured")] += 1
            continue
        if source is None:
            counts[(MISSING, "")] += 1
            continue
        from ..geometry import estimate_geometry  # only here: a build of recorded runs imports no scipy
        from ..registration import prepare_source

        try:
            prepared = prepared or prepare_source(source["bytes"])
            found = estimate_geometry(prepared, value["bytes"])
        except (ValueError, OSError):  # an unreadable image: its row says nothing it cannot back
            found = None
        if found is None:
            counts[(COMPUTED, "unmeasured")] += 1
            continue
        attempt.geometry = GeometryRecord(aligned=found.aligned, shift_px=round(found.shift_px, 3),
                                          scale=round(found.scale, 5), rotation_deg=round(found.rotation_deg, 3))
        counts[(COMPUTED, "aligned" if found.aligned else "misaligned")] += 1
    return counts


def alignment_columns(attempt: AttemptRecord) -> dict:
    """The row's alignment columns (module docstring); all null when the attempt was not measured."""
    record = attempt.geometry
    if record is None:
        return dict.fromkeys(COLUMNS)
    aligned = True if record.action == "registered" else record.aligned
    return {"aligned": aligned, "shift_px": record.shift_px, "scale": record.scale,
            "rotation_deg": record.rotation_deg}


def alignment_note(counts: Counter, sources: dict | None) -> str:
    """What the alignment columns hold in this build, for the card (`counts`: fill_geometry's, summed)."""
    recorded = sum(n for (origin, _), n in counts.items() if origin == RECORDED)
    computed = sum(n for (origin, _), n in counts.items() if origin == COMPUTED)
    missing = counts[(MISSING, "")]
    if not recorded and not computed:
        hint = "" if sources is not None else " (build with `--source-images DIR` to measure them)"
        return ("In this build they are null: the runs recorded no measurement, and one needs the source image to be "
                f"made{hint}.")
    told = [f"{recorded:,} were measured by the run's geometry guard when it made them"] if recorded else []
    if computed:
        told.append(f"{computed:,} were measured at build time from source and edit")
    if missing:
        told.append(f"{missing:,} are null (no record, and no source image to measure)")
    moved = {"registered": counts[(RECORDED, "registered")], "rejected": counts[(RECORDED, "rejected")],
             "kept": counts[(RECORDED, "recorded")] + counts[(COMPUTED, "misaligned")]}
    words = {"registered": "warped back onto the source's grid by the run (their rows hold the registered image, "
                           "`aligned` true; the editor's own image stays in the run's medbanana-originals/)",
             "rejected": "rejected before the judge (`failed` rows only, with the guard's verdict)",
             "kept": "kept as they came (`aligned` false)"}
    parts = [f"{n:,} {words[k]}" for k, n in moved.items() if n]
    if len(parts) == 1:  # one fate for all: its count once, not twice
        parts = [f"all {words[next(k for k, n in moved.items() if n)]}"]
    unmeasured = counts[(RECORDED, "unmeasured")] + counts[(COMPUTED, "unmeasured")]
    return (f"Of the attempt images, {'; '.join(told)}. **Misaligned attempts** (the frame moved beyond the "
            f"tolerances): {sum(moved.values()):,}" + (f", {parts[0]}" if len(parts) == 1 else
                                                       f": {', '.join(parts)}" if parts else "")
            + (f"; {unmeasured:,} could not be measured (null)" if unmeasured else "") + ".")
