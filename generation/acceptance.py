"""Acceptance rules: which judged attempt becomes a task's accepted edit, written as one line of text.

A rule is what `generate --accept` records in the run (an identity key) and what `build --accept` re-decides a run
with, so it is text that parses back to itself:

    qualified                  the judge's `qualified`                                   (the default)
    score>=0.85                the weighted rubric score (40/25/20/15) at least 0.85
    all(structure_reasonable,looks_realistic)    these rubric booleans all pass
    none                       nothing is accepted
    chest_xray:score>=0.85;fundus:qualified      one of the above per modality; a modality not named accepts nothing

Every rule but `none` also requires instruction compliance (the finding present after add, absent after remove).
A policy file (`medbanana calibrate --out POLICY.json`) holds a rule with the guarantee it was chosen under;
`rule_option` takes a rule or such a file, as the `--accept` options do. Reading a policy is the user's choice of
file: a rule recorded in a run is only ever parsed as a rule.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .records import RUBRIC_WEIGHTS
from .failures import NotFound, UsageError

DEFAULT_ACCEPT = "qualified"  # the judge's decision, with compliance for the direction
POLICY_FORMAT = "medbanana-acceptance-policy"
POLICY_VERSION = 1
# the rubric booleans a rule may require besides compliance (has_disease read for the direction), by weight
OPTIONAL_DIMENSIONS = tuple(d for d in RUBRIC_WEIGHTS if d != "has_disease")
_SCORE = re.compile(r"score>=([0-9]*\.?[0-9]+)")
_ALL = re.compile(r"all\(([a-z_,]*)\)")
SCORE_TOLERANCE = 1e-6  # scores are recorded to 4 decimals; a dataset holds them as float32 (0.65 -> 0.6499999762)
_HINT = ("use 'qualified', 'score>=0.7', 'all(structure_reasonable,looks_realistic)', 'none', one of them per "
         "modality ('chest_xray:score>=0.8;fundus:qualified'), or a POLICY.json made by `medbanana calibrate`")


def compliant(values: Mapping, direction: str) -> bool:
    """The finding present after add, absent after remove (an unjudged has_disease complies with neither)."""
    has = values.get("has_disease")
    return has is True if direction == "add" else has is False


@dataclass(frozen=True)
class Criterion:
    """One modality's test: `kind` qualified | score | all | none."""

    kind: str
    threshold: float = 0.0  # score
    required: tuple[str, ...] = ()  # all: OPTIONAL_DIMENSIONS in their order

    @property
    def text(self) -> str:
        if self.kind == "score":
            return f"score>={self.threshold!r}"
        if self.kind == "all":
            return f"all({','.join(self.required)})"
        return self.kind

    def passes(self, values: Mapping, direction: str) -> bool:
        """Whether an attempt with these verdict values (VERDICT_COLUMNS' names; None = not judged) passes."""
        if self.kind == "none" or not compliant(values, direction):
            return False
        if self.kind == "qualified":
            return values.get("qualified") is True
        if self.kind == "score":
            score = values.get("score")
            return score is not None and score >= self.threshold - SCORE_TOLERANCE
        return all(values.get(name) is True for name in self.required)

    @classmethod
    def parse(cls, text: str, spec: str) -> Criterion:
        if text in ("qualified", "none"):
            return cls(text)
        if m := _SCORE.fullmatch(text):
            threshold = float(m[1])
            if threshold > 1:  # the weighted rubric score lies in [0, 1]: such a policy would silently accept nothing
                raise UsageError(f"acceptance policy {spec!r}: the rubric score is between 0 and 1, so nothing would "
                                 "pass; use e.g. 'score>=0.7'")
            return cls("score", threshold=threshold)
        if m := _ALL.fullmatch(text):
            named = [name for name in m[1].split(",") if name]
            unknown = sorted(set(named) - set(OPTIONAL_DIMENSIONS))
            if unknown:
                raise UsageError(f"acceptance policy {spec!r}: all(...) names rubric booleans of "
                                 f"{', '.join(OPTIONAL_DIMENSIONS)} (compliance is always required), not "
                                 f"{', '.join(unknown)}")
            return cls("all", required=tuple(d for d in OPTIONAL_DIMENSIONS if d in named))
        raise UsageError(f"unknown acceptance policy {spec!r}; {_HINT}")


@dataclass(frozen=True)
class AcceptanceRule:
    """A rule for every modality (`default`), or one per modality (`by_modality`; others accept nothing)."""

    default: Criterion | None
    by_modality: tuple[tuple[str, Criterion], ...] = ()

    @classmethod
    def parse(cls, spec: str) -> AcceptanceRule:
        """The rule a text names (blanks ignored); ValueError naming what is wrong.

        >>> AcceptanceRule.parse("fundus: qualified; chest_xray:score >= 0.8").text
        'chest_xray:score>=0.8;fundus:qualified'
        >>> AcceptanceRule.parse("all(looks_realistic,structure_reasonable)").text
        'all(structure_reasonable,looks_realistic)'
        """
        compact = re.sub(r"\s+", "", str(spec))
        if ":" not in compact:
            return cls(Criterion.parse(compact, spec))
        parts: dict[str, Criterion] = {}
        for part in compact.split(";"):
            modality, sep, text = part.partition(":")
            if not sep or not re.fullmatch(r"[a-z][a-z0-9_]*", modality):
                raise UsageError(f"acceptance policy {spec!r}: a per-modality rule is 'modality:rule;...' for every "
                                 f"part, not {part!r}")
            if modality in parts:
                raise UsageError(f"acceptance policy {spec!r}: {modality} is named twice")
            parts[modality] = Criterion.parse(text, spec)
        return cls(None, tuple(sorted(parts.items())))

    @classmethod
    def per_modality(cls, criteria: Mapping[str, Criterion]) -> AcceptanceRule:
        return cls(None, tuple(sorted(criteria.items())))

    @property
    def text(self) -> str:
        if self.default is not None:
            return self.default.text
        return ";".join(f"{modality}:{criterion.text}" for modality, criterion in self.by_modality)

    def criterion(self, modality: str | None) -> Criterion:
        if self.default is not None:
            return self.default
        return dict(self.by_modality).get(modality or "", Criterion("none"))

    def accepts(self, values: Mapping, direction: str, modality: str | None) -> bool:
        """Whether an attempt of a task of this direction and modality, judged `values`, is accepted.

        >>> rule = AcceptanceRule.parse("score>=0.8")
        >>> rule.accepts({"has_disease": True, "score": 0.85}, "add", "fundus")
        True
        >>> rule.accepts({"has_disease": True, "score": 0.85}, "remove", "fundus")  # the finding is still there
        False
        """
        return self.criterion(modality).passes(values, direction)


def read_policy(path: Path) -> dict:
    """A policy file made by `medbanana calibrate`, its rule checked; ValueError (one line) for anything else."""
    path = Path(path)
    try:
        policy = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NotFound(f"acceptance policy not found: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a readable policy file ({exc})") from None
    if not isinstance(policy, dict) or policy.get("format") != POLICY_FORMAT:
        raise UsageError(f"{path}: not an acceptance policy made by `medbanana calibrate` (no format "
                         f"{POLICY_FORMAT!r})")
    if policy.get("version") != POLICY_VERSION:
        raise UsageError(f"{path}: policy version {policy.get('version')!r}; this medbanana reads version "
                         f"{POLICY_VERSION}")
    if not isinstance(policy.get("rule"), str):
        raise UsageError(f"{path}: the policy names no rule")
    AcceptanceRule.parse(policy["rule"])
    return policy


def rule_option(text: str) -> tuple[str, dict | None]:
    """An `--accept` value: a rule (kept as written) or a POLICY.json (its rule, and the policy). ValueError when
    neither."""
    text = str(text)
    if text.strip().lower().endswith(".json"):
        policy = read_policy(Path(text))
        return policy["rule"], policy
    AcceptanceRule.parse(text)
    return text, None
