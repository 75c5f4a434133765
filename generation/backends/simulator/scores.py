"""MedEBench-style 0-10 scores from the pixel judge's measurements (judge.py `PixelJudge.measure`).

Every measurement the verdict compares with a threshold becomes a margin: how far it is on the good side, 1 at the
threshold itself (ratio to the limit for one-sided limits; for the grain ratio, the distance of its log from 0
against the log of the nearer limit). A margin m maps to 0-10 by `ramp`: 6 m up to the threshold, then 6 + 4 (m - 1),
capped at 10 (twice as good as needed). So an edit that just passes a check scores 6, one that misses it scores
less in proportion, and each score rises monotonically with each of its measurements:

editing_accuracy (instruction compliance)
  add     ramp of min(cnr / CNR_MIN, mean change / change floor) x min(1, core area / min_area)
          x min(1, direction share / its minimum); an unchanged image scores 0.
  remove  ramp of the lesion evidence left against the nearer of its two limits (EVIDENCE_MIN and REDUCTION_MAX
          x the original's evidence; none left: 10); a lesion the judge cannot see in the original scores 0,
          since its removal cannot be confirmed.
visual_quality (structural plausibility 25, realism 20, as in the rubric)
  structure  the lowest ramp of: share of the change inside the anatomy (its complement against 0.15), extent
             (changed share against max_share + 0.05), edge energy kept (against 0.35), newly saturated share
             (against 0.04), add (not fundus): lesion brightness over the brightest tissue (against the margin);
             remove: change to the region's normal anatomy, repair edge density (both limits), and once the lesion
             is gone the repair's mismatch with its healthy reference.
  realism    the lowest ramp of grain ratio (both limits) and border transition width; 10 without either
             (dots and lines carry no grain or body).
  VQ = (25 structure + 20 realism) / 45.

Fidelity (SSIM outside, spill, global shift) is context preservation, which `medbanana eval` measures from pixels,
so it is in neither score. A ground-truth edit is not used: the pixel judge grades against the source.
"""

from __future__ import annotations

import math

RAMP_AT_THRESHOLD = 6.0
SCALE = 10.0


def ramp(margin: float) -> float:
    """0-10 from a margin (1 = exactly at the threshold, larger = better)."""
    if margin <= 1.0:
        return RAMP_AT_THRESHOLD * max(margin, 0.0)
    return min(SCALE, RAMP_AT_THRESHOLD + (SCALE - RAMP_AT_THRESHOLD) * (margin - 1.0))


def _below(value: float, limit: float) -> float:
    """Margin of a value that must stay at or under `limit` (a non-positive value is a perfect 10)."""
    return math.inf if value <= 0 else limit / value


def _log_band(ratio: float, low: float, high: float) -> float:
    """Margin of a ratio that must stay within [low, high] around 1, on a log scale."""
    distance = math.log(max(ratio, 1e-6))
    if distance == 0:
        return math.inf
    return math.log(high) / distance if distance > 0 else math.log(low) / distance


def lesion_left(m: dict, t) -> bool:
    """Whether a removal leaves the finding in place (measurements `m` of a removal): it was never seen in the
    original (so its removal cannot be confirmed), or the edit still shows it clearly or barely reduced."""
    if not m["lesion_in_source"]:
        return True
    return m["evidence_after"] >= t.evidence_min or m["evidence_after"] > t.reduction_max * m["evidence_before"]


def editing_accuracy(m: dict, direction: str, t) -> float:
    if direction == "add":
        if not m["changed_pixels"]:
            return 0.0
        strength = min(m["cnr"] / t.cnr_min, m["mean_change"] / t.change_floor)
        return ramp(strength * min(1.0, m["changed_pixels"] / m["min_area"])
                    * min(1.0, m["direction_share"] / t.direction_share))
    if not m["lesion_in_source"]:
        return 0.0
    return ramp(_below(m["evidence_after"], min(t.evidence_min, t.reduction_max * m["evidence_before"])))


def structure(m: dict, direction: str, modality: str, t) -> float:
    margins = [_below(1.0 - m["envelope_share"], 1.0 - t.envelope_share),
               _below(m["changed_share"], m["max_share"] + 0.05),
               m["structure_kept"] / t.structure_kept_min,
               _below(m["saturated_share"], t.saturation_max)]
    if direction == "add" and modality != "fundus":
        margins.append(_below(m["lesion_peak"] - m["tissue_ceiling"], t.brightness_margin))
    if direction == "remove":
        margins += [_below(m["core_change"], t.core_change_max), _below(m["repair_edges"], t.repair_edges_max)]
        if not lesion_left(m, t):  # a repair to judge only once the lesion is gone (as the verdict)
            margins.append(_below(m["mismatch_after"], t.mismatch_max))
        if modality != "fundus" and m["lesion_pixels"]:
            margins.append(m["repair_edges"] / t.repair_edges_min)
    return min(ramp(x) for x in margins)


def realism(m: dict, t) -> float:
    margins = []
    if m["grain_ratio"] is not None:
        margins.append(_log_band(m["grain_ratio"], t.grain_low, t.grain_high))
    if m["edge_width"] is not None:
        margins.append(m["edge_width"] / t.edge_width_min)
    return min((ramp(x) for x in margins), default=SCALE)


def visual_quality(m: dict, direction: str, modality: str, t) -> float:
    return (25 * structure(m, direction, modality, t) + 20 * realism(m, t)) / 45


def scores(m: dict, direction: str, modality: str, t) -> dict:
    """{"editing_accuracy", "visual_quality", "structure", "realism"} on 0-10 (2 decimals) from measurements `m`
    and the judge's thresholds `t`."""
    return {"editing_accuracy": round(editing_accuracy(m, direction, t), 2),
            "visual_quality": round(visual_quality(m, direction, modality, t), 2),
            "structure": round(structure(m, direction, modality, t), 2), "realism": round(realism(m, t), 2)}
