"""`medbanana calibrate`: expert labels + the judge's recorded verdicts -> an acceptance rule with a guarantee.

The candidate rules form a chain fixed before any label is read: every score level the judge gave (strictest
first), or the booleans' chain (qualified, then all three optional rubric booleans, then fewer). For each, the
edits it would accept are each task's first attempt that passes it: the build's accepted edits under that rule.
Its labelled ones are a random sample of them (the calibration sample is drawn from every judged attempt), so the
experts' approvals among them test "precision < P" exactly (generation/guarantee.py); Learn-then-Test's fixed
sequence keeps, among the rules rejected before the first that is not, the one of largest yield. Per modality,
each modality has its own chain at delta / M. A candidate whose labelled accepted edits are too few to pass even
if all were approved is passed over (that depends on the sample, not on the labels).

Edits the rule cannot decide with confidence: unlabelled judged attempts on which the chosen rule and its
neighbours in the chain disagree (the score band at the threshold), and attempts whose judge repeats disagree
(`judge-agreement --repeats`' verdicts.jsonl).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..generation.guarantee import (StratumCount, clopper_pearson_lower, labels_needed, min_labels, precision_p_value,
                                 stratified_lower_bound, stratified_p_value)
from ..evaluation.agreement import cohen_kappa
from ..generation.acceptance import (OPTIONAL_DIMENSIONS, POLICY_FORMAT, POLICY_VERSION, AcceptanceRule, Criterion,
                                     compliant)
from ..generation.records import VERDICT_BOOLEANS, as_bool, rubric_score
from .judged import ExpertLabel, JudgedAttempt, JudgedTask, sample_check
from .reliability import bootstrap_interval
from ..generation.failures import NotFound, UsageError
from ..generation.files import read_user_text

FAMILIES = ("score", "booleans")
POOLED = "all modalities"


class TooFewLabels(UsageError):
    """No rule passes: the message says how many more labels would be needed (exit 2)."""


def candidates(family: str, tasks: list[JudgedTask]) -> list[Criterion]:
    """The chain of rules tested, strictest first (fixed by the judge's verdicts, never by the labels)."""
    if family == "score":
        levels = {a.values["score"] for t in tasks for a in t.attempts
                  if a.values.get("score") is not None and compliant(a.values, t.direction)}
        return [Criterion("score", threshold=level) for level in sorted(levels, reverse=True)]
    if family == "booleans":
        return [Criterion("qualified"), *(Criterion("all", required=OPTIONAL_DIMENSIONS[:k]) for k in (3, 2, 1, 0))]
    raise UsageError(f"--rule is one of {', '.join(FAMILIES)}, not {family!r}")


def accepted_edits(tasks: list[JudgedTask], rule: Criterion | AcceptanceRule) -> dict[str, JudgedAttempt]:
    """uid -> the task's accepted edit under `rule` (its modality's criterion): its first attempt that passes."""
    found = {}
    for task in tasks:
        criterion = rule.criterion(task.modality) if isinstance(rule, AcceptanceRule) else rule
        first = next((a for a in task.attempts if criterion.passes(a.values, task.direction)), None)
        if first is not None:
            found[task.uid] = first
    return found


@dataclass
class Test:
    """One candidate of a chain, tested (or passed over)."""

    rule: str
    accepted: int  # tasks it accepts an edit of
    labelled: int  # labelled edits among those
    approved: int  # of them, approved by the experts
    p_value: float | None = None  # None: passed over (too few labelled to pass at all)
    lower_bound: float | None = None  # of its precision, at the group's level
    rejected: bool = False  # "precision < P" rejected: the rule is safe

    def to_json(self) -> dict:
        return dict(vars(self))


class Group:
    """The tasks one chain is tested on (all, or one modality's), its labels and its share of delta."""

    def __init__(self, name: str, tasks: list[JudgedTask], labels: dict[str, ExpertLabel], delta: float,
                 weighted: bool):
        self.name, self.tasks, self.delta, self.weighted = name, tasks, delta, weighted
        ids = {a.id for t in tasks for a in t.attempts}
        self.labels = {i: label for i, label in labels.items() if i in ids}
        self.stratum = {a.id: t.stratum for t in tasks for a in t.attempts}

    def test(self, criterion: Criterion, target: float) -> Test:
        edits = accepted_edits(self.tasks, criterion)
        inside = [self.labels[e.id] for e in edits.values() if e.id in self.labels]
        approved = sum(label.qualified for label in inside)
        found = Test(criterion.text, len(edits), len(inside), approved)
        if self.weighted:  # unequal inclusion probabilities: per-stratum bounds, each stratum weighed by its size
            strata = self._strata(edits, inside)
            best = [StratumCount(s.weight, s.labelled, s.labelled) for s in strata]
            if stratified_lower_bound(best, self.delta) < target:
                return found
            found.p_value = stratified_p_value(strata, target)
            found.lower_bound = stratified_lower_bound(strata, self.delta)
        else:
            if precision_p_value(len(inside), len(inside), target) > self.delta:
                return found
            found.p_value = precision_p_value(approved, len(inside), target)
            found.lower_bound = clopper_pearson_lower(approved, len(inside), self.delta)
        found.rejected = found.p_value <= self.delta
        return found

    def _strata(self, edits: dict[str, JudgedAttempt], inside: list[ExpertLabel]) -> list[StratumCount]:
        sizes = Counter(self.stratum[e.id] for e in edits.values())
        labelled = Counter(self.stratum[label.id] for label in inside)
        approved = Counter(self.stratum[label.id] for label in inside if label.qualified)
        total = sum(sizes.values())
        return [StratumCount(n / total, approved[s], labelled[s]) for s, n in sorted(sizes.items())]

    def shortfall(self, chain: list[Criterion], target: float, labels_total: int) -> dict | None:
        """The fewest more labels (the group's, at its current mix) with which some rule of the chain would pass,
        if the experts kept approving its edits at the rate seen so far (all of them when none is labelled)."""
        judged = sum(len(t.attempts) for t in self.tasks)
        best = None
        for criterion in chain:
            edits = accepted_edits(self.tasks, criterion)
            inside = [self.labels[e.id] for e in edits.values() if e.id in self.labels]
            approved = sum(label.qualified for label in inside)
            level = self.delta / (len({self.stratum[e.id] for e in edits.values()}) if self.weighted else 1)
            needed = labels_needed(approved, len(inside), target, level) if inside else min_labels(target, level)
            if needed is None or not edits:
                continue
            more = max(1, math.ceil(needed * judged / len(edits)) - labels_total)  # labels fall in it by its share
            if best is None or more < best["more"]:
                best = {"more": more, "rule": criterion.text, "approved": approved, "labelled": len(inside)}
        return best


def calibrate(tasks: list[JudgedTask], labels: list[ExpertLabel], *, target: float, delta: float,
              family: str = "score", per_modality: bool = False, band: int = 1, repeats: dict | None = None,
              bootstrap: int = 2000, seed: int = 0) -> dict:
    """The policy (what POLICY.json holds); TooFewLabels when no rule passes for any group."""
    if not 0 < target < 1:
        raise UsageError(f"--target-precision is a share between 0 and 1 (exclusive), not {target}")
    if not 0 < delta < 1:
        raise UsageError(f"--delta is a probability between 0 and 1 (exclusive), not {delta}")
    if band < 0:
        raise UsageError(f"--band is a number of neighbouring rules, 0 or more, not {band}")
    judged = {a.id: (t, a) for t in tasks for a in t.attempts}
    matched = {label.id: label for label in labels if label.id in judged}
    if not matched:
        example = f" (e.g. {labels[0].id!r})" if labels else ""
        raise UsageError(f"none of the {len(labels)} labelled ids is a judged attempt of the source{example}: "
                         "were the labels drawn from it?")
    is_sample, sample_note = sample_check(list(matched.values()), tasks)
    weights = {label.inclusion_probability for label in matched.values()}
    weighted = is_sample and len(weights) > 1
    chain = candidates(family, tasks)
    names = sorted({t.modality for t in tasks if t.attempts}) if per_modality else [POOLED]
    groups = [Group(name, [t for t in tasks if per_modality is False or t.modality == name], matched,
                    delta / len(names), weighted) for name in names]
    chosen: dict[str, tuple[Criterion, Test]] = {}
    tested: dict[str, list[dict]] = {}
    for group in groups:
        group_chain = candidates(family, group.tasks) if per_modality else chain
        results = []
        for criterion in group_chain:
            result = group.test(criterion, target)
            results.append((criterion, result))
            if result.p_value is not None and not result.rejected:
                break  # fixed sequence: the first rule not rejected ends the testing
        tested[group.name] = [r.to_json() for _, r in results]
        safe = [(c, r) for c, r in results if r.rejected]
        if safe:
            chosen[group.name] = max(safe, key=lambda cr: cr[1].accepted)  # the stricter on a tie (max keeps first)
    if not chosen:
        raise TooFewLabels(_too_few(groups, chain, family, per_modality, target, len(matched)))
    if per_modality:
        rule = AcceptanceRule.per_modality({name: criterion for name, (criterion, _r) in chosen.items()})
    else:
        rule = AcceptanceRule(chosen[POOLED][0])
    accepted = accepted_edits(tasks, rule)
    by_group = {name: {"rule": criterion.text, "accepted": result.accepted, "labelled": result.labelled,
                       "approved": result.approved, "p_value": result.p_value, "lower_bound": result.lower_bound,
                       "delta": next(g.delta for g in groups if g.name == name)}
                for name, (criterion, result) in chosen.items()}
    overall = sum(g["lower_bound"] * g["accepted"] for g in by_group.values()) / max(1, len(accepted))
    modalities = sorted({t.modality for t in tasks})
    return {
        "format": POLICY_FORMAT, "version": POLICY_VERSION, "rule": rule.text, "target_precision": target,
        "delta": delta, "family": family, "per_modality": per_modality,
        "method": ("Learn-then-Test, fixed sequence from the strictest rule; "
                   + ("per stratum Clopper-Pearson bounds, Bonferroni (unequal inclusion probabilities)" if weighted
                      else "exact binomial tail (Clopper-Pearson)")),
        "guarantee": (f"expert precision of the accepted edits >= {target:g} with probability >= {1 - delta:g}"
                      + (" in every modality with a rule" if per_modality else "")),
        "bound": overall, "groups": by_group, "tested": tested,
        "modalities_without_rule": [m for m in names if m not in chosen] if per_modality else [],
        "yield": _yield(tasks, accepted, modalities),
        "labels": {"count": len(labels), "matched": len(matched), "unmatched": len(labels) - len(matched),
                   "approved": sum(label.qualified for label in matched.values()),
                   "calibration_sample": is_sample, "sample_note": sample_note},
        "kappa": _kappa(matched, judged, rule, bootstrap, seed),
        "undecided": undecided(tasks, rule, chosen, family, per_modality, band, matched, repeats),
        "expert_labels": [_label_json(label, *judged[label.id]) for label in matched.values()],
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _yield(tasks: list[JudgedTask], accepted: dict[str, JudgedAttempt], modalities: list[str]) -> dict:
    def share(subset: list[JudgedTask]) -> dict:
        n = sum(t.uid in accepted for t in subset)
        return {"tasks": len(subset), "accepted": n, "share": n / len(subset) if subset else None}

    return {**share(tasks), "by_modality": {m: share([t for t in tasks if t.modality == m]) for m in modalities}}


def _kappa(labels: dict[str, ExpertLabel], judged: dict, rule: AcceptanceRule, bootstrap: int, seed: int) -> dict:
    """Cohen's kappa of the rule's decision on each labelled attempt against the experts', with a 95 % percentile
    bootstrap interval over the labelled attempts."""
    import numpy as np

    pairs = np.array([(rule.accepts(a.values, t.direction, t.modality), label.qualified)
                      for label in labels.values() for t, a in [judged[label.id]]], dtype=int).reshape(-1, 2)

    def kappa(rows) -> float | None:
        return cohen_kappa(zip(rows[:, 0].tolist(), rows[:, 1].tolist()))

    interval = bootstrap_interval(pairs, kappa, repeats=bootstrap, seed=seed)
    return {"value": kappa(pairs), "ci95": list(interval) if interval else None, "n": len(pairs),
            "agreement": float((pairs[:, 0] == pairs[:, 1]).mean()) if len(pairs) else None,
            "what": "the rule's decision on each labelled attempt vs the experts' qualified"}


def _label_json(label: ExpertLabel, task: JudgedTask, _attempt) -> dict:
    return {"id": label.id, "qualified": label.qualified, "modality": task.modality, "direction": task.direction,
            "sample": label.sample, "inclusion_probability": label.inclusion_probability,
            "stratum_size": label.stratum_size}


def undecided(tasks: list[JudgedTask], rule: AcceptanceRule, chosen: dict, family: str, per_modality: bool,
              band: int, labels: dict, repeats: dict | None) -> list[dict]:
    """Unlabelled judged attempts the rule cannot decide with confidence: at its boundary (a neighbour of the
    chosen rule in the chain, `band` either side, decides them otherwise), or judged differently by repeats."""
    found: dict[str, dict] = {}
    for name, (criterion, _result) in chosen.items():
        group = [t for t in tasks if not per_modality or t.modality == name]
        chain = candidates(family, group)
        at = chain.index(criterion)
        neighbours = [c for c in chain[max(0, at - band): at + band + 1] if c != criterion]
        for task in group:
            for attempt in task.attempts:
                if attempt.id in labels:
                    continue
                decision = criterion.passes(attempt.values, task.direction)
                if any(n.passes(attempt.values, task.direction) != decision for n in neighbours):
                    found[attempt.id] = {"id": attempt.id, "why": "at the rule's boundary",
                                         "score": attempt.values.get("score"), "accepted_by_rule": decision}
    for task in tasks:
        for attempt in task.attempts:
            verdicts = (repeats or {}).get(attempt.id)
            if attempt.id in labels or attempt.id in found or not verdicts:
                continue
            decisions = {rule.accepts(_with_score(v, task.direction), task.direction, task.modality)
                         for v in verdicts} | {rule.accepts(attempt.values, task.direction, task.modality)}
            if len(decisions) > 1:
                found[attempt.id] = {"id": attempt.id, "why": "judge repeats disagree",
                                     "score": attempt.values.get("score"), "accepted_by_rule": None}
    return sorted(found.values(), key=lambda e: e["id"])


def _with_score(labels: dict, direction: str) -> dict:
    """A repeat's booleans with the weighted score they give (the judges' score is the rubric's of its booleans)."""
    values = {d: as_bool(labels.get(d)) for d in VERDICT_BOOLEANS}
    ok = {d: bool(values.get(d)) for d in OPTIONAL_DIMENSIONS}
    values["score"] = rubric_score(compliant(values, direction), ok["structure_reasonable"], ok["looks_realistic"],
                                   ok["fidelity_preserved"])
    return values


def read_repeats(path: Path) -> dict[str, list[dict]]:
    """`judge-agreement --repeats K`'s verdicts.jsonl: id -> its repeated verdicts' booleans."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"--repeated-verdicts: not found: {path} (the verdicts.jsonl `medbanana judge-agreement "
                                "--repeats K` writes)")
    found: dict[str, list[dict]] = {}
    for line_no, line in enumerate(read_user_text(path, "--repeated-verdicts ").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            repeats = [r for r in entry.get("repeats") or [] if isinstance(r, dict)]
            found[str(entry["id"])] = repeats
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{path}:{line_no}: not a line of judge-agreement's verdicts.jsonl") from None
    return found


def _too_few(groups: list[Group], chain: list[Criterion], family: str, per_modality: bool, target: float,
             labels: int) -> str:
    parts, hopeless = [], []
    for group in groups:
        group_chain = candidates(family, group.tasks) if per_modality else chain
        need = group.shortfall(group_chain, target, len(group.labels))
        where = f"{group.name}: " if per_modality else ""
        if need is None:
            hopeless.append(group.name)
            continue
        seen = (f"{need['approved']} of {need['labelled']} approved so far" if need["labelled"]
                else "none labelled yet, if all were approved")
        parts.append(f"{where}about {need['more']} more for {need['rule']} ({seen})")
    head = f"too few labels for any rule at precision {target:g} ({labels} labelled edits matched)"
    if not parts:
        return (f"{head}: no rule reaches it at the approval rates seen so far, so more labels alone would not "
                "help; try a lower --target-precision or a larger --delta")
    return f"{head}: {'; '.join(parts)}" + (f"; {', '.join(hopeless)}: none reaches it" if hopeless else "")
