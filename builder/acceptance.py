"""`build --accept`: re-deciding a run's recorded verdicts by a rule, and the card's statement of expert approval.

Re-deciding makes no call: each task's accepted edit becomes its first judged attempt that passes the rule; the
attempts after it stay as judged attempts (`judge`, `conversations`), and a task none of whose attempts passes
becomes failed (one stopped by an API failure stays so). With expert labels (`--reviews`, or the labels a
POLICY.json of `medbanana calibrate` carries), the card states the share of the accepted edits an expert approves
by prediction-powered inference (generation/guarantee.py): the judge's `qualified` on every accepted edit, rectified
by the experts' labels on the labelled ones, each stratum (modality and direction) weighed by its size.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from ..generation.acceptance import AcceptanceRule
from ..generation.records import as_bool, verdict_values
from ..generation.outcomes import TaskStatus
from ..generation.guarantee import PPIStratum, ppi_mean
from ..generation.dataset.review_folder import CALIBRATION, IN_TURNS, ReviewFolder
from ..generation.rundir.task_records import TaskRecord
from .stats import BuildStats

MIN_STRATUM_LABELS = 2  # labels a stratum holding accepted edits needs for its error to be estimated


def redecide(task: TaskRecord, rule: AcceptanceRule) -> TaskRecord:
    """The task as the rule decides it from its recorded verdicts (a copy; the record read is not changed)."""
    accepted = None
    attempts = []
    for attempt in task.attempts:
        passes = (accepted is None and attempt.verdict is not None
                  and rule.accepts(verdict_values(attempt.verdict), task.direction, task.modality))
        copy = msgspec.structs.replace(attempt, accepted=passes)
        accepted = copy if passes else accepted
        attempts.append(copy)
    status = (TaskStatus.SUCCESS if accepted is not None else TaskStatus.API_FAILED
              if task.status == TaskStatus.API_FAILED else TaskStatus.FAILED)
    return msgspec.structs.replace(
        task, attempts=attempts, accepted=accepted, status=status,
        success_round=accepted.round if accepted is not None else None,
        final_image=accepted.image if accepted is not None else None,
        final_prompt=accepted.instruction if accepted is not None else task.final_prompt)


def note_judged(stats: BuildStats, task: TaskRecord, labelled: frozenset[str]) -> None:
    """What the expert-approval estimate needs of a built task: judged attempts per stratum, the judge's label on
    its accepted edit, and how the labelled attempts were decided."""
    stratum = (task.modality or "unknown", task.direction)
    accepted = task.accepted
    for attempt in task.attempts:
        if attempt.verdict is None:
            continue
        stats.judged[stratum] += 1
        judge = as_bool(attempt.verdict.qualified) is True
        if attempt is accepted:
            stats.approval[(*stratum, judge)] += 1
        edit = f"{task.uid}#{attempt.round}"
        if edit in labelled:
            stats.labelled[(edit, *stratum, attempt is accepted, judge)] += 1


@dataclass(frozen=True)
class ExpertLabel:
    qualified: bool
    design: str  # review_folder's CALIBRATION, ESCALATION, IN_TURNS


def review_labels(stores: Iterable[ReviewFolder]) -> dict[str, ExpertLabel]:
    """id -> the raters' majority on `qualified` of each answered rubric item (a tie gives no label)."""
    found: dict[str, ExpertLabel] = {}
    for store in stores:
        settings = store.settings
        if settings.mode != "rubric":
            continue
        votes: dict[str, list[bool]] = {}
        for stored in store.answers():
            if stored.answer.qualified is not None:
                votes.setdefault(stored.item_id, []).append(stored.answer.qualified)
        for item in store.items():
            yes = sum(votes.get(item.item_id, []))
            no = len(votes.get(item.item_id, [])) - yes
            if yes != no and item.sample_id not in found:
                found[item.sample_id] = ExpertLabel(yes > no, settings.design or IN_TURNS)
    return found


def policy_labels(policy: dict) -> dict[str, ExpertLabel]:
    """The labels a POLICY.json of `medbanana calibrate` carries."""
    found = {}
    for entry in policy.get("expert_labels") or []:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str) and isinstance(entry.get("qualified"), bool):
            found[entry["id"]] = ExpertLabel(entry["qualified"], str(entry.get("sample") or IN_TURNS))
    return found


def expert_approval(stats: BuildStats, labels: dict[str, ExpertLabel]) -> dict:
    """The PPI estimate of the accepted edits' expert-approval rate, overall and per modality (where every stratum
    holding accepted edits has MIN_STRATUM_LABELS labels), and what it rests on. Labels of a calibration sample,
    where there are any, are used alone: labels drawn otherwise (an escalation review) are not random."""
    found = [(edit, modality, direction, inside, judge) for (edit, modality, direction, inside, judge) in
             stats.labelled if edit in labels]
    designs = Counter(labels[edit].design for edit, *_ in found)
    left_out = 0
    if designs[CALIBRATION] and len(designs) > 1:  # a calibration sample beside others: it alone is random
        left_out = len(found) - designs[CALIBRATION]
        found = [entry for entry in found if labels[entry[0]].design == CALIBRATION]
        designs = Counter({CALIBRATION: len(found)})
    out: dict = {"labels": len(found), "approved": sum(labels[e].qualified for e, *_ in found),
                 "calibration_sample": bool(found) and set(designs) == {CALIBRATION},
                 "designs": dict(sorted(designs.items())), "left_out": left_out, "overall": None,
                 "by_modality": {}}
    modalities = sorted({m for (m, _d, _j) in stats.approval})
    for name in ("overall", *modalities):
        def mine(modality: str, name: str = name) -> bool:
            return name == "overall" or modality == name

        accepted: Counter = Counter()
        judge_total = 0
        for (modality, direction, judge), n in stats.approval.items():
            if mine(modality):
                accepted[(modality, direction)] += n
                judge_total += n * judge
        strata = [PPIStratum(size, accepted[h], [float(labels[e].qualified - judge) if inside else 0.0
                                                 for (e, m, d, inside, judge) in found if (m, d) == h])
                  for h, size in sorted(stats.judged.items()) if mine(h[0])]
        estimate = ppi_mean(sum(accepted.values()), judge_total, strata) if _enough(strata) else None
        entry = {"accepted": sum(accepted.values()), "judge_approved": judge_total,
                 "labelled_accepted": sum(1 for (_e, m, _d, inside, _j) in found if inside and mine(m)),
                 "estimate": None if estimate is None else vars(estimate)}
        if name == "overall":
            out["overall"] = entry
        else:
            out["by_modality"][name] = entry
    return out


def _enough(strata: list[PPIStratum]) -> bool:
    return all(len(s.rectifiers) >= MIN_STRATUM_LABELS for s in strata if s.accepted)


def recorded_rules(run_dirs: Iterable) -> list[str]:
    """The acceptance rules our runs recorded (medbanana-run.json's `accept`); none for other runs."""
    from ..generation.rundir import schema

    found = set()
    for run_dir in run_dirs:
        try:
            rule = (schema.read_run_config(run_dir) or {}).get("accept")
        except (ValueError, OSError, AttributeError):  # linked out, unreadable: the card names no rule for it
            continue
        if isinstance(rule, str):
            found.add(rule)
    return sorted(found)


def acceptance_note(rule: str | None, policy: dict | None, recorded: list[str], approval: dict | None,
                    escape) -> str:
    """The card's section on how edits were accepted and how many an expert approves (`escape`: card.md_escape,
    for every value from the data or a file)."""
    if rule is not None:
        head = (f"This build re-decided the runs' recorded verdicts, without any new judge call, by the rule "
                f"**{escape(rule)}**: each task's accepted edit is its first judged attempt that passes it (the "
                "finding present after add, absent after remove, is always required); attempts after it are kept as "
                "judged attempts in `judge` and `conversations`, and a task with none passing is failed.")
    elif recorded:
        head = f"Edits were accepted as the runs decided, by the rule(s) {', '.join(escape(r) for r in recorded)}."
    else:
        head = ("Edits were accepted as the runs decided (the judge's `qualified` and compliance, unless recorded "
                "otherwise).")
    parts = ["## Acceptance and expert approval", "", head]
    if policy is not None:
        kappa = policy.get("kappa") or {}
        interval = kappa.get("ci95")
        labels = policy.get("labels") or {}
        delta = policy.get("delta")
        parts += ["", (
            f"The rule comes from a policy made by `medbanana calibrate` with {_int(labels.get('matched'))} expert "
            f"labels: **expert precision of the accepted edits at least {_num(policy.get('target_precision'))} with "
            f"probability at least {_num(1 - delta if isinstance(delta, (int, float)) else None)}** ({escape(policy.get('method', ''))}); "
            f"precision lower bound reached {_num(policy.get('bound'))}; the rule's agreement with the experts, "
            f"Cohen's kappa {_num(kappa.get('value'))}"
            + (f" (95 % interval {_num(interval[0])} to {_num(interval[1])})" if interval else "") + ". "
            + ("The labels are a calibration sample." if labels.get("calibration_sample") else
               "**The labels are not a calibration sample**, so this guarantee assumes what they may not satisfy.")
            + " The guarantee covers edits like the labelled ones: not labels that misrepresent the runs, raters "
            "who drift, nor runs whose edits differ from those it was calibrated on.")]
    if approval and approval.get("labels"):
        parts += ["", _approval_text(approval, escape)]
    return "\n".join(parts)


def _approval_text(approval: dict, escape) -> str:
    overall = approval["overall"]
    if approval["calibration_sample"]:
        sample = "a calibration sample" + (f"; {approval['left_out']} labels of other reviews left out"
                                           if approval.get("left_out") else "")
    else:
        sample = ("not a calibration sample (" + ", ".join(f"{n} {escape(d)}" for d, n in approval["designs"].items())
                  + "): the interval assumes they are a random sample within each modality and direction, which "
                  "they may not be")
    if overall["estimate"] is None:
        return (f"**Expert approval.** {approval['labels']} expert labels match this build's judged attempts "
                f"({sample}), too few for an interval: every modality and direction holding accepted edits needs "
                f"{MIN_STRATUM_LABELS} labelled attempts.")
    est = overall["estimate"]
    per = [f"{escape(m)} {_pct(e['estimate'])}" for m, e in approval["by_modality"].items() if e["estimate"]]
    return (f"**Expert approval.** An estimated **{_pct(est)}** of the {overall['accepted']:,} accepted edits would "
            f"be approved (qualified) by an expert: prediction-powered inference from {approval['labels']} expert "
            f"labels ({sample}) and the judge's `qualified` on every accepted edit ({overall['judge_approved']:,} "
            "of them qualified by the judge), each modality and direction weighed by its judged attempts."
            + (f" Per modality: {'; '.join(per)}." if per else ""))


def _pct(estimate: dict) -> str:
    """The estimate shown within [0, 1] (the unbiased one, kept in medbanana-build.json, may lie just outside)."""
    shown = min(1.0, max(0.0, estimate["estimate"]))
    return f"{shown:.1%} (95 % interval {estimate['low']:.1%} to {estimate['high']:.1%})"


def _num(value) -> str:
    return "n/a" if not isinstance(value, (int, float)) else f"{value:.3g}"


def _int(value) -> str:
    return str(value) if isinstance(value, int) else "?"
