"""Counterfactual validity: does an independent classifier see the finding change the way the edit claims?

For every edit whose disease the classifier knows, the classifier scores the source and the edited image:

* ``delta`` — the target finding's probability on the edit minus on the source (add should raise it, remove
  lower it);
* ``crossed`` — the edit moved the target across `threshold` in the claimed direction (add: source below, edit at
  or above; remove: source at or above, edit below);
* ``other_change`` — the mean absolute change of the classifier's *other* taxonomy findings (minimality: an edit
  that changes only the target keeps this near 0).

Per modality, disease and direction: the mean delta, the share in the claimed direction, the share crossing the
threshold and the mean other change. Edits whose disease the classifier has no output for are counted, not scored.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .classifiers import Classifier
from .inputs import Sample, read_image
from .separability import _ref_key


def target_effect(p_source: np.ndarray, p_edit: np.ndarray, target: int, direction: str,
                  threshold: float) -> dict:
    """One edit's numbers from the classifier's probability vectors on its source and its edit."""
    delta = float(p_edit[target] - p_source[target])
    if direction == "add":
        crossed = bool(p_source[target] < threshold <= p_edit[target])
    else:
        crossed = bool(p_source[target] >= threshold > p_edit[target])
    others = [i for i in range(len(p_source)) if i != target]
    other_change = float(np.abs(p_edit[others] - p_source[others]).mean()) if others else None
    return {"p_source": float(p_source[target]), "p_edit": float(p_edit[target]), "delta": delta,
            "right_direction": delta > 0 if direction == "add" else delta < 0, "crossed": crossed,
            "other_change": other_change}


def run_counterfactual(samples: Iterable[Sample], classifier: Classifier, *, threshold: float = 0.5,
                       progress=None) -> dict:
    """Per-sample records and per-group rows (see the module docstring)."""
    records, not_covered, errors = [], {}, []
    source_probs: dict[str, np.ndarray] = {}  # a source edited several times is classified once
    pending: list[tuple[Sample, int, np.ndarray, np.ndarray | None]] = []

    def flush() -> None:
        new_sources = {_ref_key(s.source): image for s, _, _, image in pending if image is not None}
        if new_sources:
            source_probs.update(zip(new_sources, classifier.predict(list(new_sources.values()))))
        edits = classifier.predict([edited for _, _, edited, _ in pending])
        for (sample, target, _, _), p_edit in zip(pending, edits):
            p_source = source_probs[_ref_key(sample.source)]
            records.append({"id": sample.id, "modality": sample.modality, "disease": sample.disease,
                            "direction": sample.direction,
                            **target_effect(p_source, p_edit, target, sample.direction, threshold)})
            if progress is not None:
                progress()
        pending.clear()

    queued: set[str] = set()
    for sample in samples:
        if sample.problem or sample.source is None or sample.edited is None:
            continue
        target = classifier.index(sample.disease)
        if target is None:
            not_covered[sample.disease] = not_covered.get(sample.disease, 0) + 1
            continue
        key = _ref_key(sample.source)
        try:
            edited = read_image(sample.edited)
            source = None if key in source_probs or key in queued else read_image(sample.source)
        except Exception as exc:  # noqa: BLE001 — an unreadable image is this sample's error, the others go on
            errors.append({"id": sample.id, "error": f"{type(exc).__name__}: {exc}"})
            continue
        queued.add(key)
        pending.append((sample, target, edited, source))
        if len(pending) >= 32:
            flush()
    if pending:
        flush()
    return {"settings": {"classifier": classifier.name, "threshold": threshold, "labels": classifier.labels},
            "rows": group_rows(records), "samples": records, "not_covered": not_covered, "errors": errors}


def group_rows(records: list[dict]) -> list[dict]:
    """Per (modality, disease, direction), then per direction over all diseases."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault((record["modality"], record["disease"], record["direction"]), []).append(record)
    for direction in sorted({r["direction"] for r in records}):
        groups[("all", "all", direction)] = [r for r in records if r["direction"] == direction]
    rows = []
    for (modality, disease, direction), members in sorted(groups.items(), key=lambda kv: (kv[0][0] == "all", kv[0])):
        others = [r["other_change"] for r in members if r["other_change"] is not None]
        rows.append({"modality": modality, "disease": disease, "direction": direction, "edits": len(members),
                     "mean_delta": float(np.mean([r["delta"] for r in members])),
                     "right_direction": float(np.mean([r["right_direction"] for r in members])),
                     "crossed": float(np.mean([r["crossed"] for r in members])),
                     "other_change": float(np.mean(others)) if others else None})
    return rows
