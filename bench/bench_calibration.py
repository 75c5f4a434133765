"""Does `medbanana calibrate`'s guarantee hold, and does the card's expert-approval interval cover?

A simulator run (the offline demo's phantoms, made once into --work and reused) gives the judged attempts. Its
experts are simulated with a known relation to the judge's weighted score: an attempt of score s in modality m is
approved with probability sigmoid(SLOPE * (s - MIDPOINT) + SHIFT[m]). Each draw:

1. draws every judged attempt's expert verdict from that law (the draw's truth);
2. draws a calibration sample as `medbanana review --calibration` does (review/items.py), its labels the truth's;
3. calibrates as `medbanana calibrate` does (review/calibrate.py) at --target-precision P and --delta D;
4. re-decides the run with the chosen rule as `build --accept` does and estimates the accepted edits' approval
   rate as the card does (builder/acceptance.py: prediction-powered inference, 95 % interval).

Printed: the share of draws whose true precision (the truth's approval rate among the accepted edits; also the
law's expected rate) falls below P, which must be at most D, with a Clopper-Pearson interval; how often no rule
passed; the yield; and the PPI interval's coverage of the accepted edits' true approval rate (target >= 93 %),
also for the run's own acceptance (a rule not chosen from the labels). Exit code 1 when a check fails.

    .venv/bin/python bench/bench_calibration.py --draws 200
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from medbanana.builder.acceptance import ExpertLabel as BuildLabel
from medbanana.builder.acceptance import expert_approval, note_judged, redecide
from medbanana.generation.guarantee import clopper_pearson
from medbanana.generation.dataset.review_folder import CALIBRATION
from medbanana.generation.rundir.runs import discover_units, read_tasks
from medbanana.builder.stats import BuildStats
from medbanana.evaluation.inputs import Sample
from medbanana.generation.acceptance import AcceptanceRule
from medbanana.review.calibrate import TooFewLabels, accepted_edits, calibrate
from medbanana.review.items import calibration_sample
from medbanana.review.judged import ExpertLabel, judged_tasks

SLOPE, MIDPOINT = 9.5, 0.63  # P(approve | score 1.0) = 0.97, 0.85: 0.89, 0.75: 0.76, 0.6: 0.43 (shift 0)
SHIFT = {"chest_xray": 0.0, "brain_mri": -0.6, "fundus": 0.4}


def approval_law(score: float | None, modality: str) -> float:
    return 1 / (1 + math.exp(-(SLOPE * ((score or 0.0) - MIDPOINT) + SHIFT.get(modality, 0.0))))


def make_run(work: Path, normal: int, diseased: int, size: int) -> Path:
    from medbanana.demo import run_demo

    run_demo(work, n_normal=normal, n_diseased=diseased, size=size, quiet=True, build_dataset=False)
    return work / "run"


def as_samples(tasks) -> list[Sample]:
    """The judged attempts as the review's sampler sees them (no image needed to draw the sample)."""
    return [Sample(id=a.id, dataset="", modality=t.modality, disease="", direction=t.direction, instruction="",
                   source=None, edited=None, recorded_verdict=a.values, accepted=None)
            for t in tasks for a in t.attempts]


def approval_interval(records, rule, truth, labelled):
    """The card's interval for the accepted edits under `rule` (None: the run's own decisions), and their truth."""
    stats = BuildStats()
    ids = frozenset(labelled)
    accepted_truth = []
    for record in records:
        task = redecide(record, rule) if rule is not None else record
        note_judged(stats, task, ids)
        if task.accepted is not None:
            accepted_truth.append(truth[f"{task.uid}#{task.accepted.round}"])
    labels = {i: BuildLabel(truth[i], CALIBRATION) for i in labelled}
    estimate = expert_approval(stats, labels)["overall"]["estimate"]
    true_rate = sum(accepted_truth) / len(accepted_truth) if accepted_truth else None
    return estimate, true_rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="folder of the simulator run (made when absent; default: a temp "
                                                   "folder)")
    parser.add_argument("--normal", type=int, default=8, help="demo --normal (default 8)")
    parser.add_argument("--diseased", type=int, default=4, help="demo --diseased (default 4)")
    parser.add_argument("--size", type=int, default=128, help="demo --size (default 128)")
    parser.add_argument("--draws", type=int, default=200, help="simulated label sets (default 200)")
    parser.add_argument("--labels", type=int, default=150, help="calibration sample size (default 150)")
    parser.add_argument("--target-precision", type=float, default=0.85, help="P (default 0.85)")
    parser.add_argument("--delta", type=float, default=0.1, help="D (default 0.1)")
    parser.add_argument("--per-modality", action="store_true", help="calibrate one rule per modality")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-calibration-"))
    started = time.perf_counter()
    run = make_run(work, args.normal, args.diseased, args.size)
    made = time.perf_counter() - started
    tasks = judged_tasks(run)
    records = [record for unit in discover_units(run) for record in read_tasks(unit)]
    samples = as_samples(tasks)
    modality_of = {a.id: (t.modality, a.values.get("score")) for t in tasks for a in t.attempts}
    print(f"run {run}: {len(tasks)} tasks, {len(samples)} judged attempts ({made:.0f} s); experts: approve with "
          f"sigmoid({SLOPE} (score - {MIDPOINT}) + {SHIFT}); P {args.target_precision}, D {args.delta}, "
          f"{args.labels} labels per draw, {args.draws} draws{', per modality' if args.per_modality else ''}")

    rng = random.Random(args.seed)
    violations = expected_violations = no_rule = 0
    yields, rules, covered, covered_own, widths = [], Counter(), [], [], []
    no_interval = [0, 0]  # draws where the card states no interval (a stratum with accepted edits lacks labels)
    started = time.perf_counter()
    for draw in range(args.draws):
        truth = {i: rng.random() < approval_law(score, modality) for i, (modality, score) in modality_of.items()}
        picked, design = calibration_sample(samples, args.labels, seed=args.seed * 100_003 + draw)
        labels = [ExpertLabel(s.id, truth[s.id], CALIBRATION, *design[s.id]) for s in picked]
        estimate, true_rate = approval_interval(records, None, truth, design)
        if estimate is None:
            no_interval[0] += 1
        else:
            covered_own.append(estimate["low"] <= true_rate <= estimate["high"])
        try:
            policy = calibrate(tasks, labels, target=args.target_precision, delta=args.delta,
                               per_modality=args.per_modality, bootstrap=0)
        except TooFewLabels:
            no_rule += 1
            continue
        rule = AcceptanceRule.parse(policy["rule"])
        rules[rule.text] += 1
        accepted = accepted_edits(tasks, rule)
        precision = sum(truth[a.id] for a in accepted.values()) / len(accepted)
        expected = sum(approval_law(a.values.get("score"), t.modality) for t in tasks
                       if (a := accepted.get(t.uid))) / len(accepted)
        violations += precision < args.target_precision
        expected_violations += expected < args.target_precision
        yields.append(policy["yield"]["share"])
        estimate, true_rate = approval_interval(records, rule, truth, design)
        if estimate is None:
            no_interval[1] += 1
        else:
            covered.append(estimate["low"] <= true_rate <= estimate["high"])
            widths.append(estimate["high"] - estimate["low"])
    seconds = time.perf_counter() - started

    decided = args.draws - no_rule
    share = violations / args.draws
    low, high = clopper_pearson(violations, args.draws)
    coverage = sum(covered) / len(covered) if covered else float("nan")
    coverage_own = sum(covered_own) / len(covered_own) if covered_own else float("nan")
    print(f"draws with a rule: {decided} of {args.draws} (no rule passed in {no_rule}); rules chosen: "
          + ", ".join(f"{r} x{n}" for r, n in rules.most_common(5)))
    print(f"true precision < P: {violations} of {args.draws} draws = {share:.1%} (95 % CI {low:.1%} to {high:.1%}); "
          f"the law's expected precision < P: {expected_violations}; must be <= D = {args.delta:.0%}")
    if yields:
        print(f"yield of the chosen rule: mean {sum(yields) / len(yields):.1%} of tasks")
    print(f"PPI 95 % interval covers the accepted edits' true approval rate: chosen rule {coverage:.1%} of "
          f"{len(covered)} draws (mean width {sum(widths) / max(1, len(widths)):.3f}); the run's own acceptance "
          f"{coverage_own:.1%} of {len(covered_own)} draws; must be >= 93 %. No interval stated (too few labels in "
          f"a stratum): {no_interval[1]} and {no_interval[0]} draws")
    print(f"{seconds:.1f} s for {args.draws} draws")
    ok = share <= args.delta and coverage >= 0.93 and coverage_own >= 0.93
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
