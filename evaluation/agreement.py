"""`medbanana judge-agreement`: how far the judge can be trusted.

* Repeat consistency: each edit judged K times by a backend; the share of edits whose K verdicts are identical on
  all five booleans (has_disease, structure_reasonable, looks_realistic, fidelity_preserved, qualified) and, per
  dimension, the share of edits where it flipped (the paper: 87.2 % identical over 500 edits at temperature 0.7).
* Agreement with human labels from a CSV: one row per edit, an ``id`` column (the sample id, ``<uid>#<round>``
  for runs and datasets) or ``uid`` and ``round`` columns, ``qualified`` and any of the other four dimensions as
  true/false (yes/no, 1/0, pass/fail). Per dimension: agreement, Cohen's kappa and the confusion matrix; for
  qualified also too strict (judge rejects what the human accepts) and too lenient (the reverse), as shares of
  all compared edits (the paper: 81 % agreement, 12 % strict, 7 % lenient on 100 edits). The judge's labels are
  the verdicts recorded in the run or dataset; edits without one are judged once by the backend.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..generation.files import atomic_write_text
from ..generation.tables import Table
from ..generation.records import VERDICT_BOOLEANS, as_bool, strict_bool
from .inputs import Sample, image_bytes
from .judging import judge_once, labels
from ..generation.failures import UsageError
from ..generation.files import read_user_text

DIMENSIONS = VERDICT_BOOLEANS


# ---------------------------------------------------------------- statistics

def cohen_kappa(pairs: Iterable[tuple]) -> float | None:
    """Cohen's kappa of two raters' labels, (po - pe) / (1 - pe); None when chance agreement is total."""
    pairs = list(pairs)
    if not pairs:
        return None
    n = len(pairs)
    observed = sum(a == b for a, b in pairs) / n
    categories = {a for a, _ in pairs} | {b for _, b in pairs}
    expected = sum((sum(a == c for a, _ in pairs) / n) * (sum(b == c for _, b in pairs) / n) for c in categories)
    return None if expected == 1 else (observed - expected) / (1 - expected)


def confusion(pairs: Iterable[tuple[bool, bool]]) -> dict[str, int]:
    """Counts of (judge, human) outcomes of boolean labels."""
    counts = dict.fromkeys(("judge_yes_human_yes", "judge_yes_human_no", "judge_no_human_yes", "judge_no_human_no"), 0)
    for judge, human in pairs:
        counts[f"judge_{'yes' if judge else 'no'}_human_{'yes' if human else 'no'}"] += 1
    return counts


def repeat_consistency(repeats: dict[str, list[dict[str, bool]]]) -> dict:
    """Identical-verdict rate and per-dimension flip rates over edits judged K >= 2 times."""
    edits = {i: vs for i, vs in repeats.items() if len(vs) >= 2}
    n = len(edits)
    identical = sum(all(v == vs[0] for v in vs) for vs in edits.values())
    flips = {d: sum(len({v[d] for v in vs}) > 1 for vs in edits.values()) for d in DIMENSIONS}
    return {"edits": n, "repeats": min((len(v) for v in edits.values()), default=0), "identical": identical,
            "identical_rate": identical / n if n else None, "flips": flips,
            "flip_rate": {d: flips[d] / n if n else None for d in DIMENSIONS}}


def human_agreement(judge: dict[str, dict], human: dict[str, dict]) -> dict:
    """Per dimension labelled by both: agreement, kappa, confusion; strict / lenient rates for qualified."""
    common = [i for i in human if i in judge]
    out = {"edits": len(common), "unmatched_human_ids": sorted(set(human) - set(judge)), "dimensions": {}}
    for dim in DIMENSIONS:
        pairs = [(judge[i][dim], human[i][dim]) for i in common
                 if judge[i].get(dim) is not None and human[i].get(dim) is not None]
        if not pairs:
            continue
        counts = confusion(pairs)
        entry = {"edits": len(pairs), "agreement": sum(a == b for a, b in pairs) / len(pairs),
                 "kappa": cohen_kappa(pairs), "confusion": counts}
        if dim == "qualified":
            entry["too_strict"] = counts["judge_no_human_yes"] / len(pairs)
            entry["too_lenient"] = counts["judge_yes_human_no"] / len(pairs)
        out["dimensions"][dim] = entry
    return out


def read_human_labels(path: Path) -> dict[str, dict[str, bool | None]]:
    with io.StringIO(read_user_text(path), newline="") as fh:
        reader = csv.DictReader(fh)
        fields = set(reader.fieldnames or ())
        if "qualified" not in fields or not ({"id"} <= fields or {"uid", "round"} <= fields):
            raise UsageError(f"{path}: needs a qualified column and an id column (or uid and round); "
                             f"found {', '.join(sorted(fields)) or 'no header'}")
        labels_by_id = {}
        for line_no, row in enumerate(reader, start=2):
            edit = row["id"] if row.get("id") else f"{row['uid']}#{row['round']}"
            if edit in labels_by_id:
                raise UsageError(f"{path}:{line_no}: edit {edit!r} is labelled twice")
            labels_by_id[edit] = {d: _boolean(row.get(d), f"{path}:{line_no} {d}") for d in DIMENSIONS}
            if labels_by_id[edit]["qualified"] is None:
                raise UsageError(f"{path}:{line_no}: qualified is empty")
    return labels_by_id


def _boolean(value: str | None, where: str) -> bool | None:
    if not (value or "").strip():
        return None
    try:
        return strict_bool(value)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}") from None


def recorded_labels(sample: Sample) -> dict[str, bool | None] | None:
    if sample.recorded_verdict is None:
        return None
    return {d: as_bool(sample.recorded_verdict.get(d)) for d in DIMENSIONS}


# ---------------------------------------------------------------- running it

def select_ids(make_samples: Callable[[], Iterator[Sample]], *, wanted: set[str] | None, limit: int | None,
               seed: int) -> set[str]:
    """The edits to study: those labelled by humans (images are not needed to compare recorded verdicts), else a
    seeded random sample of `limit` edits whose images are all there."""
    ids = [s.id for s in make_samples() if s.id in wanted] if wanted is not None else [
        s.id for s in make_samples() if s.problem is None]
    if limit is not None and wanted is None and len(ids) > limit:
        ids = random.Random(seed).sample(ids, limit)
    return set(ids)


async def collect(samples: Iterable[Sample], chosen: set[str], judge, repeats: int, concurrency: int) -> dict:
    """id -> {recorded, repeats: [labels...], errors: [...]}; an edit without a recorded verdict is judged at least
    once when a judge is given."""
    slots = asyncio.Semaphore(max(1, concurrency))
    results: dict[str, dict] = {}

    async def one(sample: Sample, source: bytes, edited: bytes, times: int) -> None:
        entry = results[sample.id]
        for _ in range(times):
            async with slots:
                try:
                    entry["repeats"].append(labels(await judge_once(judge, sample, source, edited)))
                except Exception as exc:  # noqa: BLE001 — recorded; the edit leaves the consistency count
                    entry["errors"].append(f"{type(exc).__name__}: {exc}")

    pending = []
    for sample in samples:
        if sample.id not in chosen:
            continue
        results[sample.id] = {"id": sample.id, "recorded": recorded_labels(sample), "repeats": [], "errors": []}
        times = max(repeats, 0 if results[sample.id]["recorded"] else 1) if judge is not None else 0
        if times and sample.problem:
            results[sample.id]["errors"].append(sample.problem)
        elif times:
            pending.append(asyncio.create_task(one(sample, image_bytes(sample.source), image_bytes(sample.edited),
                                                   times)))
        if len(pending) >= 4 * max(1, concurrency):  # bounded: images of only a few edits in memory at once
            await asyncio.gather(*pending)
            pending = []
    await asyncio.gather(*pending)
    return results


def run_agreement(make_samples: Callable[[], Iterator[Sample]], out: Path, *, judge=None, repeats: int = 0,
                  human_csv: Path | None = None, limit: int | None = None, seed: int = 0, concurrency: int = 2,
                  settings: dict | None = None) -> dict:
    """Repeat consistency (repeats >= 2, needs `judge`) and/or agreement with `human_csv`; results in `out`."""
    if repeats < 2 and human_csv is None:
        raise UsageError("nothing to measure: give --repeats K (K >= 2) and/or --human CSV")
    if repeats >= 2 and judge is None:
        raise UsageError("repeat consistency needs a judge backend")
    human = read_human_labels(human_csv) if human_csv else None
    chosen = select_ids(make_samples, wanted=set(human) if human else None, limit=limit, seed=seed)
    results = asyncio.run(collect(make_samples(), chosen, judge, repeats, concurrency))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "verdicts.jsonl", "".join(
        json.dumps({**entry, "human": human.get(entry["id"]) if human else None}) + "\n" for entry in results.values()))
    report = {"settings": settings or {}, "edits": len(results),
              "judge_errors": sum(bool(e["errors"]) for e in results.values())}
    lines = ["# Judge agreement", ""]
    if repeats >= 2:
        clean = {i: e["repeats"] for i, e in results.items() if not e["errors"]}
        report["repeat_consistency"] = consistency = repeat_consistency(clean)
        table = Table(["dimension", "edits that flipped", "flip rate"], formats={"flip rate": ".1%"},
                      rows=[[d, consistency["flips"][d], consistency["flip_rate"][d]] for d in DIMENSIONS])
        table.write(out, "repeat_consistency")
        rate = consistency["identical_rate"]
        lines += ["## Repeat consistency", "", f"{consistency['identical']} of {consistency['edits']} edits judged "
                  f"{repeats} times got identical verdicts ({'–' if rate is None else f'{rate:.1%}'}); "
                  f"{report['judge_errors']} edits with a failed judge call are left out.", "", table.markdown(), ""]
    if human is not None:
        judged = {i: e["recorded"] or (e["repeats"][0] if e["repeats"] else None) for i, e in results.items()}
        judged = {i: v for i, v in judged.items() if v is not None}
        report["human_agreement"] = agreement = human_agreement(judged, human)
        report["judge_labels"] = {"recorded": sum(bool(e["recorded"]) for e in results.values()),
                                  "judged_now": sum(not e["recorded"] and bool(e["repeats"]) for e in results.values())}
        lines += ["## Agreement with human labels", "", *_agreement_lines(agreement, out), ""]
    atomic_write_text(out / "agreement.json", json.dumps(report, indent=2))
    atomic_write_text(out / "report.md", "\n".join(lines))
    return report


def _agreement_lines(agreement: dict, out: Path) -> list[str]:
    table = Table(["dimension", "edits", "agreement", "Cohen's kappa", "too strict", "too lenient"],
                  formats={"agreement": ".1%", "Cohen's kappa": ".3f", "too strict": ".1%", "too lenient": ".1%"})
    for dim, e in agreement["dimensions"].items():
        table.rows.append([dim, e["edits"], e["agreement"], e["kappa"], e.get("too_strict"), e.get("too_lenient")])
    table.write(out, "human_agreement")
    lines = [f"{agreement['edits']} edits labelled by humans and judged"
             + (f"; {len(agreement['unmatched_human_ids'])} labelled ids not found in the input"
                if agreement["unmatched_human_ids"] else "") + ".", "", table.markdown(), ""]
    if "qualified" in agreement["dimensions"]:
        c = agreement["dimensions"]["qualified"]["confusion"]
        matrix = Table(["judge \\ human", "qualified", "not qualified"],
                       rows=[["qualified", c["judge_yes_human_yes"], c["judge_yes_human_no"]],
                             ["not qualified", c["judge_no_human_yes"], c["judge_no_human_no"]]])
        matrix.write(out, "confusion_qualified")
        lines += ["Confusion matrix of `qualified`:", "", matrix.markdown()]
    return lines
